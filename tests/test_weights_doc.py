"""docs/weights.md: every ```python sample, in order, as one script; every ```bash line too."""
from conftest import doc_samples, run_doc_line, run_doc_python


def test_weights_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("weights.md")
    assert len(python) >= 7 and len(shell) >= 4
    run_doc_python(python, tmp_path / "weights_doc.py")
    for line in shell:
        run_doc_line(line)
