"""docs/embeddings.md: every ```python sample, in order, as one script."""
from conftest import doc_samples, run_doc_python


def test_embeddings_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("embeddings.md")
    assert len(python) >= 7 and not shell
    run_doc_python(python, tmp_path / "embeddings_doc.py")
