"""The README's samples run as written on the built-in models, the ones it tells offline users to use:
each hub id replaced by its tiny twin (Qwen3-0.6B by tiny, Qwen3-Embedding by tiny-embedding,
Qwen3-Reranker by tiny-reranker), with no download (HF_HUB_OFFLINE)."""

import pytest

from conftest import ROOT, doc_blocks, run_doc_line, run_doc_python

TWINS = {"Qwen/Qwen3-Embedding-0.6B": "tiny-embedding", "Qwen/Qwen3-Reranker-0.6B": "tiny-reranker",
         "Qwen/Qwen3-0.6B": "tiny"}
# not run here: an install, the server (its client sample needs it), and tensor parallelism
# (tests/test_parallel_doc.py runs the same line over 2 ranks)
ELSEWHERE = ("pip install", "npqwen serve", "from openai import OpenAI", "--tensor-parallel-size")


def readme_samples() -> list[tuple[str, str]]:
    blocks = []
    for kind, code in doc_blocks(ROOT / "README.md"):
        for hub_id, twin in TWINS.items():
            code = code.replace(hub_id, twin)
        if kind in ("python", "bash") and not any(s in code for s in ELSEWHERE[2:3]):
            blocks.append((kind, code))
    return blocks


def test_readme_python_samples_run_on_the_tiny_models(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_doc_python([code for kind, code in readme_samples() if kind == "python"], tmp_path / "readme.py")


@pytest.mark.parametrize("line", [line for kind, code in readme_samples() if kind == "bash"
                                  for line in code.splitlines() if line.strip() and not line.startswith(ELSEWHERE)
                                  and ELSEWHERE[3] not in line])
def test_readme_commands_run_on_the_tiny_models(line, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "tiny" in line, line
    run_doc_line(line)
