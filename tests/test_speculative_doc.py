"""docs/speculative.md: every ```python sample, in order, as one script; every ```bash line too."""
from conftest import doc_samples, run_doc_line, run_doc_python


def test_speculative_doc_samples_run(tmp_path):
    python, shell = doc_samples("speculative.md", shown=("text",))
    assert len(python) == 3 and len(shell) == 1
    result = run_doc_python(python, tmp_path / "speculative_doc.py")
    assert result.stdout.split() == ["True"] * 5, result.stdout
    plain = run_doc_line(shell[0].replace(" --speculative ngram:4", "")).stdout
    assert run_doc_line(shell[0]).stdout == plain and plain.strip()
