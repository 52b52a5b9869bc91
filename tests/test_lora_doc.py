"""docs/lora.md: every ```python sample, in order, as one script; every ```bash line too."""
import re

import pytest

import npqwen

from conftest import doc_samples, run_doc_line, run_doc_python
from tolerance import model_tolerance


def test_lora_doc_code_samples_run(tmp_path):
    pytest.importorskip("peft")
    python, shell = doc_samples("lora.md")
    assert len(python) >= 6
    result = run_doc_python(python, tmp_path / "lora_doc.py")
    assert "['poet', None, 'poet']" in result.stdout and "max |npqwen - PEFT| = " in result.stdout
    assert "['linear_attn.in_proj_qkv', 'linear_attn.in_proj_z', 'linear_attn.in_proj_b', 'linear_attn.in_proj_a', " \
           "'linear_attn.out_proj', 'mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj']" in result.stdout
    relative = float(result.stdout.split("hybrid: max |npqwen - PEFT| = ")[1].split("relative ")[1].split()[0])
    # the hybrid adapter equals PEFT's: tiny-qwen3.5's float32 bar over the sample's "Once upon a time" (16 byte
    # tokens; relative to max |logit|, which is above 1 on it)
    assert relative <= model_tolerance(npqwen.load("tiny-qwen3.5").config, 16), result.stdout
    assert "'attn_hyper_connection.block_inject_weight', 'self_attn.indexer.index_qk_proj', 'self_attn.q_proj'" \
           in result.stdout and "64 projections adapted" in result.stdout   # every one all-linear names
    relative = float(result.stdout.split("qwen4-exp: max |npqwen - PEFT| = ")[1].split("relative ")[1].split()[0])
    assert relative <= model_tolerance(npqwen.load("tiny-qwen4-exp").config, 16), result.stdout   # Qwen4-Exp's too
    outputs = [run_doc_line(line).stdout for line in shell]
    assert outputs[0] == outputs[2] and outputs[0].strip()   # the adapter kept apart, and merged


def test_lora_doc_says_what_its_samples_need_beyond_npqwen():
    """Each module the page's samples import that neither Python nor npqwen's dependencies bring
    (torch, transformers, peft) is in the `pip install` line at the top of the page, before the first sample."""
    import ast
    import sys

    from conftest import ROOT

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

    python, _ = doc_samples("lora.md")
    imported = {alias.name.split(".")[0] for code in python for node in ast.walk(ast.parse(code))
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for code in python for node in ast.walk(ast.parse(code))
                 if isinstance(node, ast.ImportFrom) and node.module}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=\[ ]", d)[0] for d in project["dependencies"]} | {"npqwen"}
    needed = sorted(imported - runtime - set(sys.stdlib_module_names))
    assert needed == ["peft", "torch", "transformers"], needed
    top = (ROOT / "docs" / "lora.md").read_text(encoding="utf-8").split("```")[0]
    install = re.search(r"`pip install ([^`]*)`", top)
    assert install and set(needed) <= set(install.group(1).split()), (needed, install and install.group(0))
