"""Qwen4-Exp's hyper-connections: C residual streams side by side instead of one, a learned low-rank gate
that mixes them into each block's input, and learned weights that add the block's output back into every
stream (transformers' Qwen4ExpTextGatedResidual, one before attention and one before the MLP).

Shapes: T tokens, C = hc_count streams (4), D hidden size, R = hc_lowrank (320). The residual is (T, C*D),
the C streams of D values side by side. A Qwen4-Exp decoder layer, written with these:

    a, x, w = gated_residual(x, *attn_hyper_connection weights)   # a (T, D): the attention's input
    x = inject(x, attention(a), w)                                 # every stream c gets w[:, c] * output
    m, x, w = gated_residual(x, *mlp_hyper_connection weights)
    x = inject(x, mlp(m), w)

The model (npqwen/qwen4_exp.py) runs these; they are checked step by step against transformers' modules in
tests/test_qwen4_exp.py. A LoRA adapter (npqwen/lora.py) adds to each of the three projections on its own rows:
`loras` are the batch's (adapter, rows) groups, `p` the module's HF name.
"""
from . import lora, ops
from .ops import grouped_rms_norm  # hc_norm (in ops: PLE's norms are the same)


def mix_streams(x, norm_weight, down, up, C: int, eps: float, loras=(), p: str = ""):
    """The C normalised streams mixed into one block input by a learned low-rank gate (the model's last step,
    transformers' hyper_connection_mixer). x (T, C*D); down (R, C*D), up (C*D, R) -> (mixed (T, D), h (T, C*D))."""
    T, D = x.shape[0], x.shape[1] // C
    h = grouped_rms_norm(x, norm_weight, D, eps)                                # (T, C*D)
    gate = lora.add(ops.linear(h, down), h, loras, f"{p}.input_mix_weight_down")   # (T, R) (+ scale * B A h)
    gate = ops.silu(gate / C)                                                   # (T, R): the low-rank mix
    gate = lora.add(ops.linear(gate, up), gate, loras, f"{p}.input_mix_weight_up")   # (T, C*D)
    gate = ops.sigmoid(gate).reshape(T, C, D)                                   # (T, C, D): one gate per value
    return (gate * h.reshape(T, C, D)).mean(axis=1), h                          # (T, D): the gated streams' mean


def gated_residual(x, norm_weight, down, up, inject_weight, C: int, eps: float, loras=(), p: str = ""):
    """The block's input mixed from the C normalised streams, and the weights its output is added back with.
    x (T, C*D); down (R, C*D), up (C*D, R), inject_weight (C, C*D) -> (mixed (T, D), x (T, C*D), w (T, C))."""
    mixed, h = mix_streams(x, norm_weight, down, up, C, eps, loras, p)          # (T, D), (T, C*D)
    w = lora.add(ops.linear(h, inject_weight), h, loras, f"{p}.block_inject_weight")   # (T, C)
    w = 2 * ops.sigmoid(w / C)                                                  # (T, C), each in (0, 2)
    return mixed, x, w


def inject(x, out, w):
    """Every stream c gets w[:, c] times the block's output. (T, C*D), (T, D), (T, C) -> (T, C*D)."""
    return x + (w[:, :, None] * out[:, None, :]).reshape(x.shape)               # (T, C, D) flattened
