#!/usr/bin/env bash
# Install node-llama-cpp 3.21.1 (llama.cpp v0.4.0's prebuilt CPU libraries for linux-x64, and its source
# as a git bundle with convert_hf_to_gguf.py and gguf-py) into .cache/node-llama-cpp, or the folder given,
# and unpack that source into <folder>/llama.cpp. The GGUF tests use them to write real GGUF files
# (convert_hf_to_gguf.py, llama_model_quantize), to check npqwen's Q4_K quantizer against
# quantize_row_q4_K_ref, and to read llama.cpp's own logits; they skip, saying why, when this is absent.
set -euo pipefail
dest="${1:-$(cd "$(dirname "$0")/.." && pwd)/.cache/node-llama-cpp}"
if [ -f "$dest/llama.cpp/convert_hf_to_gguf.py" ] && [ -d "$dest/node_modules/@node-llama-cpp/linux-x64/bins" ]; then exit 0; fi
command -v npm >/dev/null || { echo "npm is needed to fetch node-llama-cpp" >&2; exit 1; }
mkdir -p "$dest"
cd "$dest"
[ -f package.json ] || echo '{"name": "npqwen-llama-cpp", "private": true}' > package.json
# the CPU build only (its optional CUDA and Vulkan builds are 600 MB); no postinstall (it would build)
npm install --silent --no-audit --no-fund --ignore-scripts --omit=optional \
    node-llama-cpp@3.21.1 @node-llama-cpp/linux-x64@3.21.1
rm -rf llama.cpp
git -c advice.detachedHead=false clone --quiet node_modules/node-llama-cpp/llama/gitRelease.bundle llama.cpp
echo "node-llama-cpp and llama.cpp's source in $dest"
