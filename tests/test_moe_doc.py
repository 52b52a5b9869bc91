"""docs/moe.md: every ```python sample, in order, as one script; every ```bash line too."""
from conftest import doc_samples, run_doc_line, run_doc_python


def test_moe_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("moe.md")
    assert len(python) >= 7
    run_doc_python(python, tmp_path / "moe_doc.py")
    for line in shell:
        run_doc_line(line)
