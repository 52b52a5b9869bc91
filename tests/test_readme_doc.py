"""The README's samples run as written on the built-in models, the ones it tells offline users to use:
each hub id replaced by its tiny twin (Qwen3-0.6B by tiny, Qwen3-Embedding by tiny-embedding,
Qwen3-Reranker by tiny-reranker), with no download (HF_HUB_OFFLINE)."""

import pytest

from conftest import ROOT, doc_blocks, run_doc_line, run_doc_python

TWINS = {"Qwen/Qwen3-Embedding-0.6B": "tiny-embedding", "Qwen/Qwen3-Reranker-0.6B": "tiny-reranker",
         "Qwen/Qwen3-0.6B": "tiny"}
# not run here: an install, the server (its client sample needs it), tensor parallelism
# (tests/test_parallel_doc.py runs the same line over 2 ranks), and replicas on Ray Serve
# (tests/test_scale_out_doc.py builds the same app; tests/test_ray.py serves it on a cluster)
ELSEWHERE = ("pip install", "npqwen serve", "from openai import OpenAI", "--tensor-parallel-size",
             "serve run npqwen.ray")


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


def float32_gb(config: dict) -> float:
    """A checkpoint's size in float32, in GB (1e9 bytes); tied embeddings counted once."""
    import numpy as np

    from npqwen.checkpoint import expected_shapes
    from npqwen.config import Qwen3Config

    return sum(int(np.prod(s)) for s in expected_shapes(Qwen3Config.from_dict(config)).values()) * 4 / 1e9


def test_qwen3_0_6b_size_is_one_figure_everywhere():
    """Qwen3-0.6B is 596,049,920 parameters (its embedding tied to the lm_head), 2.4 GB in float32: the
    README's table and each page or lesson that offers `MODEL = "Qwen/Qwen3-0.6B"` with a size give that figure, in GB
    (they once said 2.4 GB, ~3 GB and 1.5 GB). The README's 32B figure is computed the same way."""
    import re

    from npqwen.config import QWEN3_0_6B_CONFIG

    size = f"{float32_gb(QWEN3_0_6B_CONFIG):.1f}"
    assert size == "2.4", size
    qwen3_32b = dict(QWEN3_0_6B_CONFIG, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                     num_attention_heads=64, tie_word_embeddings=False)   # Qwen/Qwen3-32B's config.json
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"(\S+) GB for 0\.6B", readme) == [size]
    assert re.findall(r"(\S+) GB for 32B", readme) == [f"{float32_gb(qwen3_32b):.0f}"]   # 131
    found = 0
    for path in [*sorted((ROOT / "notebooks").glob("*.md")), *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if 'MODEL = "Qwen/Qwen3-0.6B"' in line:   # the line that offers the real model, and the 3 after it
                figures = re.findall(r"([\d.~]+) ?(GB|GiB)", " ".join(lines[i:i + 4]))
                assert set(figures) <= {(size, "GB")}, (path.name, i + 1, figures)
                found += bool(figures)
    assert found >= 4, found    # walkthrough (lesson 01), lessons 02 and 05, notebooks/README.md


def test_what_the_readme_samples_import_beyond_npqwen_has_its_pip_install():
    """A module the README's samples import that neither Python nor npqwen's dependencies bring (the openai
    client: no npqwen extra installs it) is named in a `pip install ...` in the README."""
    import ast
    import re
    import sys

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    trees = [ast.parse(code) for kind, code in doc_blocks(ROOT / "README.md") if kind == "python"]
    imported = {a.name.split(".")[0] for t in trees for n in ast.walk(t) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for t in trees for n in ast.walk(t) if isinstance(n, ast.ImportFrom) and n.module}
    runtime = {re.split(r"[<>=\[ ]", d)[0]
               for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    needed = imported - runtime - {"npqwen"} - set(sys.stdlib_module_names)
    assert needed == {"openai"}, needed
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    installed = {word for line in re.findall(r"`pip install ([^`]*)`", readme) for word in line.split()}
    assert needed <= installed, (needed, installed)
