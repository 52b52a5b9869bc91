"""docs/cli.md: every ```bash line, in order, from the repository root.

The page names the models people use; the test runs each command on what the tests have in their
place: the built-in `tiny` for Qwen/Qwen3-0.6B (random weights, so only that a command succeeds is
checked, never its text), and small random checkpoints in the layouts of Qwen3-Embedding and
Qwen3-Reranker (conftest's embedding_small and reranker_small, which need the real Qwen3 tokenizer
files and skip without them) for those two. The lines that name them run in a test of their own, so
that the others run wherever the tokenizer files are missing.
"""
from conftest import doc_samples, run_doc_line

POOLING = ("Qwen/Qwen3-Embedding-0.6B", "Qwen/Qwen3-Reranker-0.6B")


def test_cli_doc_commands_run():
    shell = doc_samples("cli.md", swap={"Qwen/Qwen3-0.6B": "tiny"})[1]
    lines = [line for line in shell if not any(name in line for name in POOLING)]
    assert len(lines) >= 10
    for line in lines:
        run_doc_line(line)


def test_cli_doc_embed_and_rerank_commands_run(embedding_small, reranker_small):
    shell = doc_samples("cli.md")[1]
    lines = [line for line in shell if any(f"npqwen {c} -m {m}" in line for c in ("embed", "rerank") for m in POOLING)
             or line.startswith("printf") and "npqwen" not in line]
    assert sum("npqwen rerank" in line for line in lines) >= 2 and sum("npqwen embed" in line for line in lines) >= 3
    for line in lines:
        line = line.replace(POOLING[0], str(embedding_small)).replace(POOLING[1], str(reranker_small))
        result = run_doc_line(line)
        if "--top-n 2" in line:   # two documents, best first
            assert len(result.stdout.splitlines()) == 2
