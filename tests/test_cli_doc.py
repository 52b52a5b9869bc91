"""docs/cli.md: every ```bash line, in order, from the repository root.

The page names the models people use; the test runs each command on what the tests have in their
place: the built-in `tiny` for Qwen/Qwen3-0.6B (random weights, so only that a command succeeds is
checked, never its text), and small random checkpoints in the layouts of Qwen3-Embedding and
Qwen3-Reranker (conftest's embedding_small and reranker_small, which need the real Qwen3 tokenizer
files and skip without them) for those two. The commands that name them run in a test of their own,
so that the others run wherever the tokenizer files are missing; each test writes only the files its
own commands read.
"""
from conftest import doc_samples, run_doc_line

POOLING = ("Qwen/Qwen3-Embedding-0.6B", "Qwen/Qwen3-Reranker-0.6B")


def commands_and_their_files(pooling: bool) -> list[str]:
    """The page's lines, in order: the commands that name a pooling model (or those that do not), and
    the `printf ... > FILE` lines that write a file one of them reads."""
    shell = doc_samples("cli.md")[1]
    writes = lambda line: line.startswith("printf") and "| npqwen" not in line   # noqa: E731
    commands = [line for line in shell if not writes(line) and any(name in line for name in POOLING) == pooling]
    return [line for line in shell if line in commands
            or writes(line) and any(line.rsplit("> ", 1)[1] in command for command in commands)]


def test_cli_doc_commands_run():
    lines = commands_and_their_files(pooling=False)
    assert len(lines) >= 10
    for line in lines:
        run_doc_line(line.replace("Qwen/Qwen3-0.6B", "tiny"))


def test_cli_doc_embed_and_rerank_commands_run(embedding_small, reranker_small):
    lines = commands_and_their_files(pooling=True)
    assert sum("npqwen rerank" in line for line in lines) >= 2 and sum("npqwen embed" in line for line in lines) >= 3
    for line in lines:
        line = line.replace(POOLING[0], str(embedding_small)).replace(POOLING[1], str(reranker_small))
        result = run_doc_line(line)
        if "--top-n 2" in line:   # two documents, best first
            assert len(result.stdout.splitlines()) == 2


def test_cli_doc_embed_and_rerank_commands_run_on_the_tiny_twins():
    """The same lines offline on the built-in twins, which need no tokenizer files."""
    for line in commands_and_their_files(pooling=True):
        run_doc_line(line.replace(POOLING[0], "tiny-embedding").replace(POOLING[1], "tiny-reranker"))
