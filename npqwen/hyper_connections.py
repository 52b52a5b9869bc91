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

Each has its backward beside it (npqwen/grad.py runs them in reverse): the gradient of its output(s) -> the
gradients of its input and its weights, recomputing what the forward did not keep. A projection's backward is
`linear_backward(d_y, x, weight, name) -> (d_x, d_weight or None)`: ops.linear_backward by default; grad.py's adds
the path of the LoRA adapter being trained and keeps its gradients.
"""
from . import lora, ops
from .backend import xp_of
from .ops import grouped_rms_norm, grouped_rms_norm_backward  # hc_norm (in ops: PLE's norms are the same)


def plain_linear_backward(d_y, x, weight, name: str):
    """A projection's backward without an adapter: ops.linear_backward (name unused)."""
    return ops.linear_backward(d_y, x, weight)


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


def mix_streams_backward(d_mixed, x, norm_weight, down, up, C: int, eps: float, d_h=None, loras=(), p: str = "",
                         linear_backward=plain_linear_backward):
    """mixed = mean_c(sigmoid(up(silu(down(h) / C))) * h), h = hc_norm(x): d_mixed (T, D) -> d_x (T, C*D), and the
    weights' gradients d_norm_weight (C*D,), d_down (R, C*D), d_up (C*D, R). d_h (T, C*D): a gradient that reaches h
    by another road (gated_residual's injection weights), added before the norm's. loras, p: the forward's."""
    T, D = x.shape[0], x.shape[1] // C
    h = grouped_rms_norm(x, norm_weight, D, eps)                                # (T, C*D) recomputed
    pre = lora.add(ops.linear(h, down), h, loras, f"{p}.input_mix_weight_down") / C   # (T, R)
    s = ops.silu(pre)                                                           # (T, R)
    v = lora.add(ops.linear(s, up), s, loras, f"{p}.input_mix_weight_up")       # (T, C*D) before the sigmoid
    gate = ops.sigmoid(v).reshape(T, C, D)
    d_gated = xp_of(x).broadcast_to(d_mixed[:, None, :] / C, (T, C, D))         # (T, C, D): the mean's share
    d_hh = (d_gated * gate).reshape(T, C * D)                                   # h as the gated value
    d_v = ops.sigmoid_backward((d_gated * h.reshape(T, C, D)).reshape(T, C * D), v)   # h through the gate
    d_s, d_up = linear_backward(d_v, s, up, f"{p}.input_mix_weight_up")         # (T, R), (C*D, R)
    d_pre = ops.silu_backward(d_s, pre) / C                                     # (T, R)
    d_h_gate, d_down = linear_backward(d_pre, h, down, f"{p}.input_mix_weight_down")   # (T, C*D), (R, C*D)
    d_hh = d_hh + d_h_gate + (0 if d_h is None else d_h)
    d_x, d_norm = grouped_rms_norm_backward(d_hh, x, norm_weight, D, eps)       # (T, C*D), (C*D,)
    return d_x, d_norm, d_down, d_up


def gated_residual(x, norm_weight, down, up, inject_weight, C: int, eps: float, loras=(), p: str = ""):
    """The block's input mixed from the C normalised streams, and the weights its output is added back with.
    x (T, C*D); down (R, C*D), up (C*D, R), inject_weight (C, C*D) -> (mixed (T, D), x (T, C*D), w (T, C))."""
    mixed, h = mix_streams(x, norm_weight, down, up, C, eps, loras, p)          # (T, D), (T, C*D)
    w = lora.add(ops.linear(h, inject_weight), h, loras, f"{p}.block_inject_weight")   # (T, C)
    w = 2 * ops.sigmoid(w / C)                                                  # (T, C), each in (0, 2)
    return mixed, x, w


def gated_residual_backward(d_mixed, d_w, x, norm_weight, down, up, inject_weight, C: int, eps: float, loras=(),
                            p: str = "", linear_backward=plain_linear_backward):
    """The block input's and the injection weights' gradients back to x (the residual's own identity path, x
    returned as it came, is the caller's): d_mixed (T, D), d_w (T, C) -> d_x (T, C*D), and the gradients of
    hc_norm, input_mix_weight_down, input_mix_weight_up and block_inject_weight. loras, p: the forward's."""
    h = grouped_rms_norm(x, norm_weight, x.shape[1] // C, eps)                  # (T, C*D) recomputed
    z = lora.add(ops.linear(h, inject_weight), h, loras, f"{p}.block_inject_weight") / C   # (T, C)
    d_z = 2 * ops.sigmoid_backward(d_w, z) / C                                  # w = 2 sigmoid(z)
    d_h, d_inject = linear_backward(d_z, h, inject_weight, f"{p}.block_inject_weight")   # (T, C*D), (C, C*D)
    d_x, d_norm, d_down, d_up = mix_streams_backward(d_mixed, x, norm_weight, down, up, C, eps, d_h, loras, p,
                                                     linear_backward)
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
