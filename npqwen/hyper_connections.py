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
tests/test_qwen4_exp.py.
"""
import numpy as np

from . import ops
from .backend import xp_of


def grouped_rms_norm(x, weight, group: int, eps: float):
    """hc_norm: each stream's D values normalised on their own, then scaled by 1 + weight (float32 inside, as HF;
    float64 stays float64). (T, C*D), (C*D,) -> (T, C*D)."""
    f32 = np.promote_types(x.dtype, np.float32)
    h = x.astype(f32).reshape(x.shape[0], x.shape[1] // group, group)           # (T, C, D)
    h = h / xp_of(x).sqrt(xp_of(x).mean(h * h, axis=-1, keepdims=True) + eps)   # (T, C, D)
    return (h.reshape(x.shape) * (1.0 + weight.astype(f32))).astype(x.dtype)    # (T, C*D)


def mix_streams(x, norm_weight, down, up, C: int, eps: float):
    """The C normalised streams mixed into one block input by a learned low-rank gate (the model's last step,
    transformers' hyper_connection_mixer). x (T, C*D); down (R, C*D), up (C*D, R) -> (mixed (T, D), h (T, C*D))."""
    T, D = x.shape[0], x.shape[1] // C
    h = grouped_rms_norm(x, norm_weight, D, eps)                                # (T, C*D)
    gate = ops.silu(ops.linear(h, down) / C)                                    # (T, R): the low-rank mix
    gate = ops.sigmoid(ops.linear(gate, up)).reshape(T, C, D)                   # (T, C, D): one gate per value
    return (gate * h.reshape(T, C, D)).mean(axis=1), h                          # (T, D): the gated streams' mean


def gated_residual(x, norm_weight, down, up, inject_weight, C: int, eps: float):
    """The block's input mixed from the C normalised streams, and the weights its output is added back with.
    x (T, C*D); down (R, C*D), up (C*D, R), inject_weight (C, C*D) -> (mixed (T, D), x (T, C*D), w (T, C))."""
    mixed, h = mix_streams(x, norm_weight, down, up, C, eps)                    # (T, D), (T, C*D)
    w = 2 * ops.sigmoid(ops.linear(h, inject_weight) / C)                       # (T, C), each in (0, 2)
    return mixed, x, w


def inject(x, out, w):
    """Every stream c gets w[:, c] times the block's output. (T, C*D), (T, D), (T, C) -> (T, C*D)."""
    return x + (w[:, :, None] * out[:, None, :]).reshape(x.shape)               # (T, C, D) flattened
