"""docs/gradients.md: every ```python sample, in order, as one script, with the built-in tiny model in place of
Qwen/Qwen3-0.6B (its finite-difference checks and its attribution samples run there)."""
from conftest import doc_samples, run_doc_python


def test_gradients_doc_samples_run(tmp_path):
    python, shell = doc_samples("gradients.md", swap={"Qwen/Qwen3-0.6B": "tiny"})
    assert len(python) >= 4 and not shell
    result = run_doc_python(python, tmp_path / "gradients_doc.py")
    assert "correlation" in result.stdout and "gap" in result.stdout
