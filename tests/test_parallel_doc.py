"""docs/parallel.md: every ```python sample, in order, as one script; every ```bash line too."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, doc_samples

pytest.importorskip("mpi4py")


def test_parallel_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("parallel.md")
    assert len(python) >= 5 and len(shell) >= 1
    script = tmp_path / "parallel_doc.py"
    script.write_text("\n\n".join(python))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    print(result.stdout[-3000:])
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    for line in shell:
        result = subprocess.run(line, shell=True, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
        assert "Traceback" not in result.stderr, (line, result.stderr[-2000:])
        if "--tensor-parallel-size" in line:   # two ranks print what one process prints
            one = subprocess.run(line.replace(" --tensor-parallel-size 2", ""), shell=True, capture_output=True,
                                 text=True, cwd=ROOT, env=env, timeout=300)
            assert result.stdout == one.stdout and one.stdout
