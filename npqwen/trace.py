"""Seeing inside a forward pass: a recorder that keeps every intermediate array under its HF
module name, summaries of them, and a picture of the attention probabilities.

    trace = Trace()
    llm.forward(ids, recorder=trace)        # the same forward pass, told to report what it computes
    trace["model.layers.0.self_attn.q_norm"]  # (T, H, Dh) NumPy array

Names, in execution order (i = layer): model.embed_tokens, model.rotary_emb.cos/.sin, then per
layer model.layers.i.input_layernorm, .self_attn.q_proj/.k_proj/.v_proj, .self_attn.q_norm/
.k_norm, .self_attn.q_rope/.k_rope, .self_attn.attn_probs, .self_attn.attn_output (the input of
o_proj), .self_attn.o_proj, .attn_residual, .post_attention_layernorm, .mlp.gate_proj/.up_proj,
.mlp.act_fn (silu(gate)), .mlp.down_proj, model.layers.i (the layer's output); then
model.norm and lm_head. In a Qwen3-MoE sparse layer the MLP records instead .mlp.gate (the
router's logits, (T, E)), .mlp.gate.top_k_index (each token's chosen experts, (T, k), best
first) and .mlp.gate.top_k_weights (their weights, (T, k)), as HF's router returns them, and
.mlp.experts (the weighted sum of the chosen experts' outputs, (T, D)). HF modules without a
counterpart here get none; steps without an HF module (q_rope, attn_probs, attn_output,
attn_residual) are named after what they are.
"""
import functools
import re

import numpy as np

from .backend import to_numpy
from .errors import NpqwenError

LAYER = re.compile(r"^model\.layers\.(\d+)(\.|$)")


class Trace(dict):
    """A recorder: called as trace(name, array), it keeps a host copy of each array, in order."""

    def __init__(self, layers=None):
        super().__init__()
        self.layers = None if layers is None else set(layers)   # keep only these layers' steps

    def __call__(self, name: str, array):
        m = LAYER.match(name)
        if self.layers is None or m is None or int(m.group(1)) in self.layers:
            self[name] = np.array(to_numpy(array), copy=True)

    def summary(self) -> list[tuple]:
        """(name, shape, dtype, mean, std, min, max) per recorded array, statistics in float64."""
        rows = []
        for name, a in self.items():
            f = a.astype(np.float64)
            rows.append((name, a.shape, str(a.dtype), f.mean(), f.std(), f.min(), f.max()))
        return rows

    def table(self) -> str:
        rows = self.summary()
        width = max((len(r[0]) for r in rows), default=10)
        lines = [f"{'name':<{width}}  {'shape':<16} {'dtype':<8} {'mean':>11} {'std':>11} {'min':>11} {'max':>11}"]
        for name, shape, dtype, mean, std, lo, hi in rows:
            lines.append(f"{name:<{width}}  {str(tuple(shape)):<16} {dtype:<8} {mean:>11.4g} {std:>11.4g} "
                         f"{lo:>11.4g} {hi:>11.4g}")
        return "\n".join(lines)

    def save(self, path):
        """Every recorded array in one .npz file (".npz" added if missing), under its name: np.load(path)[name]."""
        np.savez(npz_name(path), **self)


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """"0,3,5-7" -> [0, 3, 5, 6, 7], each checked against the model's layer count."""
    layers = []
    try:
        for part in spec.split(","):
            a, _, b = part.strip().partition("-")
            layers.extend(range(int(a), int(b or a) + 1))
    except ValueError:
        raise NpqwenError(f"--layers {spec!r}: use layer numbers like 0,3,5-7") from None
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad or not layers:
        raise NpqwenError(f"--layers {spec!r}: the model has layers 0 .. {n_layers - 1}")
    return sorted(set(layers))


def pyplot():
    """matplotlib.pyplot drawing to files (no window); checked before the work that needs it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise NpqwenError("--plot-attention needs matplotlib: pip install 'npqwen[plot]' (or pip install "
                          "matplotlib)") from None
    return plt


def drawable(text: str) -> str:
    """`text` with each character matplotlib's font lacks (CJK and most emoji, in the default DejaVu Sans)
    written as its escape, \\u4e2d, so that a plot shows it instead of an empty box and a "Glyph missing"
    warning."""
    has = font_characters()
    return "".join(c if ord(c) in has else c.encode("unicode_escape").decode("ascii") for c in text)


@functools.cache
def font_characters() -> dict:
    """The code points matplotlib's default font draws (code point -> glyph index)."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    return FT2Font(font_manager.findfont(font_manager.FontProperties())).get_charmap()


def npz_name(path: str) -> str:
    """The file np.savez writes: it adds ".npz" to a name that lacks it."""
    return path if str(path).endswith(".npz") else f"{path}.npz"


def plot_attention(probs: np.ndarray, tokens: list[str], path, title: str):
    """A heatmap of attention probabilities (T queries x T keys), axes labelled with the tokens."""
    plt = pyplot()
    T = probs.shape[0]
    size = min(4 + 0.28 * T, 40)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(probs, cmap="viridis", vmin=0.0, vmax=max(float(probs.max()), 1e-9))
    labels = [drawable(t.replace("\n", "\\n")) or "\u2205" for t in tokens]
    ax.set_xticks(range(T), labels, rotation=90, fontsize=8, parse_math=False)   # a "$x$" token is text, not TeX
    ax.set_yticks(range(T), labels, fontsize=8, parse_math=False)
    ax.set_xlabel("key (attended-to token)")
    ax.set_ylabel("query token")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="probability")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
