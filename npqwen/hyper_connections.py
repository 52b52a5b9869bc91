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
tests/test_qwen4_exp.py. Each has its backward beside it (npqwen/grad.py runs them in reverse): the gradient
of its output(s) -> the gradients of its input and its weights, recomputing what the forward did not keep.
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


def grouped_rms_norm_backward(d_y, x, weight, group: int, eps: float):
    """y = n * (1 + weight), n = each stream's x / rms: d_x = r * (d_n - n * mean(d_n * n)) per stream (ops.rms_norm_
    backward's rule), d_weight = sum over tokens of d_y * n. (T, C*D) -> d_x (T, C*D), d_weight (C*D,)."""
    xp, (T, CD) = xp_of(x), x.shape
    h = x.reshape(T, CD // group, group)                                         # (T, C, D)
    inv_rms = 1.0 / xp.sqrt((h * h).mean(axis=-1, keepdims=True) + eps)         # (T, C, 1)
    n = h * inv_rms                                                             # (T, C, D) normalised
    d_n = (d_y * (1.0 + weight)).reshape(h.shape)                               # (T, C, D)
    d_x = inv_rms * (d_n - n * (d_n * n).mean(axis=-1, keepdims=True))          # (T, C, D)
    return d_x.reshape(T, CD), (d_y * n.reshape(T, CD)).sum(axis=0)


def mix_streams(x, norm_weight, down, up, C: int, eps: float):
    """The C normalised streams mixed into one block input by a learned low-rank gate (the model's last step,
    transformers' hyper_connection_mixer). x (T, C*D); down (R, C*D), up (C*D, R) -> (mixed (T, D), h (T, C*D))."""
    T, D = x.shape[0], x.shape[1] // C
    h = grouped_rms_norm(x, norm_weight, D, eps)                                # (T, C*D)
    gate = ops.silu(ops.linear(h, down) / C)                                    # (T, R): the low-rank mix
    gate = ops.sigmoid(ops.linear(gate, up)).reshape(T, C, D)                   # (T, C, D): one gate per value
    return (gate * h.reshape(T, C, D)).mean(axis=1), h                          # (T, D): the gated streams' mean


def mix_streams_backward(d_mixed, x, norm_weight, down, up, C: int, eps: float, d_h=None, weights: bool = True):
    """mixed = mean_c(sigmoid(up(silu(down(h) / C))) * h), h = hc_norm(x): d_mixed (T, D) -> d_x (T, C*D), and the
    weights' gradients d_norm_weight (C*D,), d_down (R, C*D), d_up (C*D, R) (None with weights=False). d_h (T, C*D):
    a gradient that reaches h by another road (gated_residual's injection weights), added before the norm's."""
    T, D = x.shape[0], x.shape[1] // C
    h = grouped_rms_norm(x, norm_weight, D, eps)                                # (T, C*D) recomputed
    pre = ops.linear(h, down) / C                                               # (T, R)
    s = ops.silu(pre)                                                           # (T, R)
    v = ops.linear(s, up)                                                       # (T, C*D) before the sigmoid
    gate = ops.sigmoid(v).reshape(T, C, D)
    d_gated = xp_of(x).broadcast_to(d_mixed[:, None, :] / C, (T, C, D))         # (T, C, D): the mean's share
    d_hh = (d_gated * gate).reshape(T, C * D)                                   # h as the gated value
    d_v = ops.sigmoid_backward((d_gated * h.reshape(T, C, D)).reshape(T, C * D), v)   # h through the gate
    d_s, d_up = ops.linear_backward(d_v, s, up, weights)                        # (T, R), (C*D, R)
    d_pre = ops.silu_backward(d_s, pre) / C                                     # (T, R)
    d_h_gate, d_down = ops.linear_backward(d_pre, h, down, weights)             # (T, C*D), (R, C*D)
    d_hh = d_hh + d_h_gate + (0 if d_h is None else d_h)
    d_x, d_norm = grouped_rms_norm_backward(d_hh, x, norm_weight, D, eps)       # (T, C*D), (C*D,)
    return d_x, (d_norm if weights else None), d_down, d_up


def gated_residual(x, norm_weight, down, up, inject_weight, C: int, eps: float):
    """The block's input mixed from the C normalised streams, and the weights its output is added back with.
    x (T, C*D); down (R, C*D), up (C*D, R), inject_weight (C, C*D) -> (mixed (T, D), x (T, C*D), w (T, C))."""
    mixed, h = mix_streams(x, norm_weight, down, up, C, eps)                    # (T, D), (T, C*D)
    w = 2 * ops.sigmoid(ops.linear(h, inject_weight) / C)                       # (T, C), each in (0, 2)
    return mixed, x, w


def gated_residual_backward(d_mixed, d_w, x, norm_weight, down, up, inject_weight, C: int, eps: float,
                            weights: bool = True):
    """The block input's and the injection weights' gradients back to x (the residual's own identity path, x
    returned as it came, is the caller's): d_mixed (T, D), d_w (T, C) -> d_x (T, C*D), and the gradients of
    hc_norm, input_mix_weight_down, input_mix_weight_up and block_inject_weight (None with weights=False)."""
    h = grouped_rms_norm(x, norm_weight, x.shape[1] // C, eps)                  # (T, C*D) recomputed
    z = ops.linear(h, inject_weight) / C                                        # (T, C)
    d_z = 2 * ops.sigmoid_backward(d_w, z) / C                                  # w = 2 sigmoid(z)
    d_h, d_inject = ops.linear_backward(d_z, h, inject_weight, weights)         # (T, C*D), (C, C*D)
    d_x, d_norm, d_down, d_up = mix_streams_backward(d_mixed, x, norm_weight, down, up, C, eps, d_h, weights)
    return d_x, d_norm, d_down, d_up, d_inject


def inject(x, out, w):
    """Every stream c gets w[:, c] times the block's output. (T, C*D), (T, D), (T, C) -> (T, C*D)."""
    return x + (w[:, :, None] * out[:, None, :]).reshape(x.shape)               # (T, C, D) flattened


def inject_backward(d_y, out, w):
    """y = x + w[:, c] * out in stream c: d_y (T, C*D) -> d_x = d_y (T, C*D), d_out (T, D) summed over the streams
    by their weights, d_w (T, C) each stream's d_y . out."""
    T, C = w.shape
    d = d_y.reshape(T, C, -1)                                                   # (T, C, D)
    return d_y, (w[:, :, None] * d).sum(axis=1), (d * out[:, None, :]).sum(axis=-1)
