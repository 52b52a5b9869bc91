"""docs/python-api.md: every ```python sample, in order, as one script, with the built-in tiny model
in place of Qwen/Qwen3-0.6B (random weights: what it generates is not checked, only what the samples
assert)."""
from conftest import doc_samples, run_doc_python


def test_python_api_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("python-api.md", swap={"Qwen/Qwen3-0.6B": "tiny"})
    assert len(python) >= 4 and not shell
    run_doc_python(python, tmp_path / "python_api_doc.py")
