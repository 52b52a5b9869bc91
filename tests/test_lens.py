"""The logit lens and direct logit attribution on the tiny models; `npqwen lens`. (The lens against HF is in
test_hooks.py, at the Qwen3-0.6B shape.)"""
import re
import subprocess
import sys

import numpy as np
import pytest

import npqwen

from tolerance import rounding_tolerance

IDS = [5, 17, 33, 2, 101, 7, 64, 250]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_the_last_layer_s_lens_is_the_model_s_distribution(name):
    llm = npqwen.load(name)
    lens = llm.logit_lens(IDS, top_k=3)
    logits = llm.forward(IDS).astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert np.array_equal(lens.top_ids[-1], np.argsort(-probs, -1, kind="stable")[:, :3])
    # the same float32 logits; the lens's softmax sums V exponentials in its own order
    bound = rounding_tolerance(llm.config.vocab_size)
    assert np.allclose(lens.top_probs[-1], np.take_along_axis(probs, lens.top_ids[-1], -1), rtol=0, atol=bound)
    assert np.allclose(lens.next_probs[-1], probs[np.arange(len(IDS) - 1), IDS[1:]], rtol=0, atol=bound)
    ranks = (probs[:-1] > probs[np.arange(len(IDS) - 1), IDS[1:]][:, None]).sum(-1)
    assert np.array_equal(lens.next_ranks[-1], ranks)


def assert_shares_add_up(llm, a, total):
    """The embedding's, each layer's attention's and MLP's shares are dot products of D with the logit's
    direction, added in another order than the residual stream added them: within D-long float32 sums chained
    over 2 per layer, relative to the sum of their sizes; each layer's heads likewise add up to its attention's."""
    cfg = llm.config
    size = abs(a.embed) + np.abs(a.attn).sum() + np.abs(a.mlp).sum()
    assert abs(total - a.logit) <= rounding_tolerance(cfg.hidden_size, 2 * cfg.num_hidden_layers + 1) * max(1.0, size)
    heads = np.abs(a.heads).sum(axis=1, keepdims=True)
    assert (np.abs(a.heads.sum(axis=1) - a.attn) <= rounding_tolerance(cfg.hidden_size, 2) * np.maximum(1.0, heads[:, 0])).all()


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("contrast", [None, 9])
def test_the_shares_add_up_to_the_logit(name, contrast):
    llm = npqwen.load(name)
    a = llm.logit_attribution(IDS, 7, contrast=contrast)
    total = a.embed + a.attn.sum() + a.mlp.sum()
    print(f"{name}: logit {a.logit:.6f}, sum of the shares {total:.6f} (embedding {a.embed:.3f}, attention "
          f"{np.round(a.attn, 3)}, MLP {np.round(a.mlp, 3)})")
    assert_shares_add_up(llm, a, total)
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


WIDE = {0: "中文", 1: "😀", 2: "a", 3: "é", 4: "$x$", 5: "\u2423Paris", 6: "東京都"}   # token id -> its text


def wide_lens():
    """A lens of 2 layers over 4 positions whose tokens are wide (CJK, emoji), narrow, combined and TeX-like."""
    from types import SimpleNamespace
    top_ids = np.array([[[0], [1], [2], [6]], [[3], [4], [5], [0]]])                 # (L, T, 1)
    return SimpleNamespace(top_ids=top_ids, top_probs=np.full(top_ids.shape, 0.25), token_ids=[6, 0, 2, 1])


def test_npqwen_lens_keeps_its_columns_when_a_token_is_wide():
    """A CJK character or an emoji takes two columns of a terminal: the table pads by columns, so each cell
    starts at the same column in every row (padding by characters shifted every cell after a CJK one)."""
    from npqwen.cli.lens import columns, lens_table, token_text

    assert [columns(t) for t in ("中文", "😀", "e\u0301", "a")] == [4, 2, 1, 1]
    assert token_text("中文中文中文") == "中文中文中" and token_text("a\nb") == "a\\nb"   # 10 columns; \n escaped
    table = lens_table(wide_lens(), WIDE.get)
    print(table)
    starts = []
    for line in table.splitlines():   # the terminal column where each cell starts, after the layer's: a cell
        cells = [m.start() for m in re.finditer(r"\S+(?: \S+)*", line)][1:]   # is split from the next by 2+ spaces
        starts.append([columns(line[:c]) for c in cells])
    assert len({tuple(s) for s in starts}) == 1, f"the cells start at different columns: {starts}\n{table}"
    assert len(starts[0]) == 4, starts


def test_the_plots_draw_every_token_without_a_missing_glyph(tmp_path):
    """`npqwen lens --plot` and `trace --plot-attention`: matplotlib's default font (DejaVu Sans) has no CJK;
    such a character is drawn as its escape (\\u4e2d), never as an empty box with a "Glyph ... missing"
    warning; a "$x$" token is text, not TeX."""
    pytest.importorskip("matplotlib")
    import warnings

    from npqwen.cli.lens import plot_lens
    from npqwen.trace import drawable, plot_attention

    assert drawable("中a\u00e9\u2423") == "\\u4e2da\u00e9\u2423"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # "Glyph 20013 (\N{CJK UNIFIED IDEOGRAPH-4E2D}) missing from font(s)" fails
        plot_lens(wide_lens(), WIDE.get, tmp_path / "lens.png")
        plot_attention(np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None], ["中文", "😀", "$x$", "東京都"],
                       tmp_path / "attention.png", "npqwen trace --plot-attention")   # the same labels there
    assert (tmp_path / "lens.png").stat().st_size > 1000 and (tmp_path / "attention.png").stat().st_size > 1000
