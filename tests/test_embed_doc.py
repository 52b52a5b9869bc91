"""docs/embeddings.md: every ```python sample of sections 1-6, in order, as one script on the tiny model;
then section 7's, which load Qwen/Qwen3-Embedding-0.6B and Qwen/Qwen3-Reranker-0.6B, as a second script
with small random checkpoints in those repositories' layouts in their place (conftest's embedding_small
and reranker_small, which need the real Qwen3 tokenizer files and skip without them)."""
from conftest import doc_samples, run_doc_python

EMBEDDING, RERANKER = "Qwen/Qwen3-Embedding-0.6B", "Qwen/Qwen3-Reranker-0.6B"


def test_embeddings_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("embeddings.md")
    python = [code for code in python if EMBEDDING not in code and RERANKER not in code]
    assert len(python) >= 7 and not shell
    run_doc_python(python, tmp_path / "embeddings_doc.py")


def test_embeddings_doc_api_samples_run(tmp_path, embedding_small, reranker_small):
    python = doc_samples("embeddings.md", swap={EMBEDDING: embedding_small, RERANKER: reranker_small})[0]
    python = [code for code in python if str(embedding_small) in code or str(reranker_small) in code]
    assert len(python) >= 1
    run_doc_python(python, tmp_path / "embeddings_api_doc.py")
