"""The logit lens and direct logit attribution on the tiny models; `npqwen lens`. (The lens against HF is in
test_hooks.py, at the Qwen3-0.6B shape.)"""
import subprocess
import sys

import numpy as np
import pytest

import npqwen

IDS = [5, 17, 33, 2, 101, 7, 64, 250]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_the_last_layer_s_lens_is_the_model_s_distribution(name):
    llm = npqwen.load(name)
    lens = llm.logit_lens(IDS, top_k=3)
    logits = llm.forward(IDS).astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert np.array_equal(lens.top_ids[-1], np.argsort(-probs, -1, kind="stable")[:, :3])
    assert np.allclose(lens.top_probs[-1], np.take_along_axis(probs, lens.top_ids[-1], -1), atol=1e-6)
    assert np.allclose(lens.next_probs[-1], probs[np.arange(len(IDS) - 1), IDS[1:]], atol=1e-6)
    ranks = (probs[:-1] > probs[np.arange(len(IDS) - 1), IDS[1:]][:, None]).sum(-1)
    assert np.array_equal(lens.next_ranks[-1], ranks)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("contrast", [None, 9])
def test_the_shares_add_up_to_the_logit(name, contrast):
    llm = npqwen.load(name)
    a = llm.logit_attribution(IDS, 7, contrast=contrast)
    total = a.embed + a.attn.sum() + a.mlp.sum()
    print(f"{name}: logit {a.logit:.6f}, sum of the shares {total:.6f} (embedding {a.embed:.3f}, attention "
          f"{np.round(a.attn, 3)}, MLP {np.round(a.mlp, 3)})")
    assert abs(total - a.logit) < 1e-4 * max(1.0, abs(a.logit))
    assert np.allclose(a.heads.sum(axis=1), a.attn, atol=1e-5)
    assert a.heads.shape == (llm.config.num_hidden_layers, llm.config.num_attention_heads)


def test_a_target_is_one_token():
    llm = npqwen.load("tiny")
    with pytest.raises(npqwen.NpqwenError, match="'ab' is 2 tokens; name one token"):
        llm.logit_attribution(IDS, "ab")
    with pytest.raises(npqwen.NpqwenError, match="top_k must be an integer"):
        llm.logit_lens(IDS, top_k=0)


def test_npqwen_lens_prints_layers_by_positions(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "lens.png"
    out = subprocess.run([sys.executable, "-m", "npqwen", "lens", "--model", "tiny", "--prompt", "Paris is",
                          "--plot", str(plot)], capture_output=True, text=True, timeout=120)
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["layer", "P", "a"] and [ln.split()[0] for ln in lines[1:]] == ["0", "1"]
    assert plot.stat().st_size > 1000 and "drawn in" in out.stderr
