"""Qwen4-Exp's hyper-connections: C residual streams side by side instead of one, a learned low-rank gate
that mixes them into each block's input, and learned weights that add the block's output back into every
stream (transformers' Qwen4ExpTextGatedResidual, one before attention and one before the MLP).

Shapes: T tokens, C = hc_count streams (4), D hidden size, R = hc_lowrank (320). The residual is (T, C*D),
the C streams of D values side by side. A Qwen4-Exp decoder layer, written with these:

    a, x, w = gated_residual(x, *attn_hyper_connection weights)   # a (T, D): the attention's input
    x = inject(x, attention(a), w)                                 # every stream c gets w[:, c] * output
    m, x, w = gated_residual(x, *mlp_hyper_connection weights)
    x = inject(x, mlp(m), w)

npqwen does not run Qwen4-Exp yet (config.py refuses it and names what is missing); these functions are
checked step by step against transformers' modules in tests/test_qwen4_exp.py.
"""
import numpy as np

from . import ops


def grouped_rms_norm(x, weight, group: int, eps: float):
    """hc_norm: each stream's D values normalised on their own, then scaled by 1 + weight (float32 inside).
    (T, C*D), (C*D,) -> (T, C*D)."""
    T = x.shape[0]
    h = x.astype(np.float32).reshape(T, -1, group)                              # (T, C, D)
    h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)               # (T, C, D)
    return (h.reshape(T, -1) * (1.0 + weight.astype(np.float32))).astype(x.dtype)   # (T, C*D)


def gated_residual(x, norm_weight, down, up, inject_weight, C: int, eps: float):
    """The block's input mixed from the C normalised streams, and the weights its output is added back with.
    x (T, C*D); down (R, C*D), up (C*D, R), inject_weight (C, C*D) -> (mixed (T, D), x (T, C*D), w (T, C))."""
    T, D = x.shape[0], x.shape[1] // C
    h = grouped_rms_norm(x, norm_weight, D, eps)                                # (T, C*D)
    gate = ops.silu(ops.linear(h, down) / C)                                    # (T, R): the low-rank mix
    gate = ops.sigmoid(ops.linear(gate, up)).reshape(T, C, D)                   # (T, C, D): one gate per value
    mixed = (gate * h.reshape(T, C, D)).mean(axis=1)                            # (T, D): the gated streams' mean
    w = 2 * ops.sigmoid(ops.linear(h, inject_weight) / C)                       # (T, C), each in (0, 2)
    return mixed, x, w


def inject(x, out, w):
    """Every stream c gets w[:, c] times the block's output. (T, C*D), (T, D), (T, C) -> (T, C*D)."""
    return x + (w[:, :, None] * out[:, None, :]).reshape(x.shape)               # (T, C, D) flattened
