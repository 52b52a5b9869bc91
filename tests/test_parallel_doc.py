"""docs/parallel.md: every ```python sample, in order, as one script; every ```bash line too."""
import pytest

from conftest import doc_samples, run_doc_line, run_doc_python

pytest.importorskip("mpi4py")


def test_parallel_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("parallel.md")
    assert len(python) >= 5 and len(shell) >= 1
    run_doc_python(python, tmp_path / "parallel_doc.py")
    for line in shell:
        result = run_doc_line(line)
        if "--tensor-parallel-size" in line:   # two ranks print what one process prints
            one = run_doc_line(line.replace(" --tensor-parallel-size 2", ""), check=False)
            assert result.stdout == one.stdout and one.stdout
