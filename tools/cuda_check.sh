#!/usr/bin/env bash
# The one command for a GPU machine: npqwen's CUDA golden checks and benchmark, results in $OUT (or --out DIR).
# --dry-run runs the same pipeline on the CPU with the strict CuPy stand-in; --help lists the options.
exec "${PYTHON:-python3}" "$(dirname "$0")/cuda_check.py" "$@"
