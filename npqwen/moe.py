"""Qwen3-MoE's sparse MLP: a router sends each token to k of E experts, small SwiGLU MLPs.

Shapes: T tokens, D hidden size, E experts, k experts per token (num_experts_per_tok),
I one expert's width (moe_intermediate_size). Qwen3-30B-A3B: D=2048, E=128, k=8, I=768.

    probs   = softmax(x @ gate^T)                  (T, E), in float32
    chosen  = the k most probable experts of each token, best first (T, k)
    weights = their probabilities (T, k), rescaled to sum 1 when norm_topk_prob
    out[t]  = sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]),  expert_e(x) = down_e(silu(gate_e x) * up_e x)

as transformers' Qwen3MoeSparseMoeBlock computes it. A token runs k of the E experts, so a
layer costs k/E of what its parameters suggest (Qwen3-30B-A3B: 3.3B of 30.5B parameters used
per token). Two pure functions over arrays (NumPy or CuPy): `route`, then `experts`; each has its
backward after it (npqwen/grad.py): the choice of experts is a step, so gradients flow through the chosen
experts' weights and outputs only.
"""
import numpy as np

from . import ops
from .backend import to_numpy, xp_of


def route(x, gate_weight, k: int, norm_topk_prob: bool):
    """The router: (logits (T, E), chosen experts (T, k), their weights (T, k)) for tokens x (T, D)."""
    xp = xp_of(x)
    logits = ops.linear(x, gate_weight)                                  # (T, D) @ (D, E) -> (T, E)
    z = logits.astype(np.promote_types(x.dtype, np.float32))             # softmax in float32, as HF
    probs = xp.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)                           # (T, E)
    chosen = xp.argsort(-probs, axis=-1, kind="stable")[:, :k]           # (T, k), most probable first
    weights = xp.take_along_axis(probs, chosen, axis=-1)                 # (T, k)
    if norm_topk_prob:   # the k chosen probabilities rescaled to sum 1
        weights /= weights.sum(axis=-1, keepdims=True)
    return logits, chosen, weights.astype(x.dtype)


def route_backward(d_weights, x, gate_weight, logits, chosen, norm_topk_prob: bool):
    """d_weights (T, k), the gradient of the chosen experts' weights -> d_x (T, D), d_gate_weight (E, D) and
    d_logits (T, E). The weights are softmax probabilities taken at `chosen` (renormalised: w = p / sum p)."""
    xp = xp_of(x)
    z = logits.astype(np.promote_types(x.dtype, np.float32))
    probs = xp.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)                           # (T, E) as route computed them
    picked = xp.take_along_axis(probs, chosen, axis=-1)                  # (T, k) before renormalising
    d_picked = d_weights
    if norm_topk_prob:   # w = p / s, s = sum p: d_p = (d_w - sum_j d_w w) / s
        total = picked.sum(axis=-1, keepdims=True)
        d_picked = (d_weights - (d_weights * (picked / total)).sum(axis=-1, keepdims=True)) / total
    d_probs = xp.zeros_like(probs)
    xp.put_along_axis(d_probs, chosen, d_picked, axis=-1)                # (T, E): zero for unchosen experts
    d_logits = (probs * (d_probs - (d_probs * probs).sum(axis=-1, keepdims=True))).astype(x.dtype)  # softmax backward
    d_x, d_gate_weight = ops.linear_backward(d_logits, x, gate_weight)   # (T, D), (E, D)
    return d_x, d_gate_weight, d_logits


def experts(x, chosen, weights, gate_up, down):
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for x (T, D); each expert that has tokens runs once.

    gate_up (E, 2I, D) holds each expert's gate_proj rows, then its up_proj rows; down is (E, D, I). (Compact
    weights, npqwen/weights.py: a list of E matrices each, which ops.linear multiplies the same way.)
    """
    xp = xp_of(x)
    T, k = chosen.shape
    E, I = len(down), down[0].shape[1]
    # The T*k (token, expert) pairs, grouped by expert with one sort: expert e's pairs become one
    # block of consecutive rows, so each expert with tokens is two matrix products over all of
    # its tokens at once, instead of one small product per token (T*k of them). The block
    # sizes go to the host: they are the loop's bounds.
    pair_expert = chosen.reshape(-1)                                     # (T*k,) pair t*k + j
    order = xp.argsort(pair_expert, kind="stable")                       # (T*k,) pairs, grouped by expert
    counts = to_numpy(xp.bincount(pair_expert, minlength=E))             # (E,) pairs per expert
    rows = x[order // k]                                                 # (T*k, D) each pair's token
    y = xp.empty_like(rows)                                              # (T*k, D)
    start = 0
    for e in np.flatnonzero(counts):
        block = slice(start, start + int(counts[e]))
        h = ops.linear(rows[block], gate_up[e])                          # (n, D) -> (n, 2I): gate | up
        y[block] = ops.linear(ops.silu(h[:, :I]) * h[:, I:], down[e])    # (n, I) -> (n, D)
        start = block.stop
    y *= weights.reshape(-1)[order][:, None]                             # each pair's router weight
    # Scatter back: row r of y is pair order[r]; in pair order the k pairs of a token are adjacent.
    pairs = xp.empty_like(y)
    pairs[order] = y                                                     # (T*k, D) in (token, choice) order
    return pairs.reshape(T, k, -1).sum(axis=1)                           # (T, k, D) -> (T, D)


def experts_backward(d_out, x, chosen, weights, gate_up, down):
    """Backward of `experts`, one expert at a time over the (token, choice) pairs it got: d_out (T, D) ->
    d_x (T, D), d_weights (T, k), d_gate_up (E, 2I, D), d_down (E, D, I) (zero for experts without tokens).
    Compact experts (lists of E matrices, npqwen/weights.py) are a frozen base (QLoRA): d_gate_up, d_down None."""
    xp = xp_of(x)
    frozen = isinstance(down, list)
    I = down[0].shape[1] if frozen else down.shape[2]
    d_x, d_weights = xp.zeros_like(x), xp.zeros(weights.shape, dtype=x.dtype)
    d_gate_up, d_down = (None, None) if frozen else (xp.zeros_like(gate_up), xp.zeros_like(down))
    for e in np.unique(to_numpy(chosen)):
        t, j = xp.nonzero(chosen == e)                                   # the pairs (token t, its j-th choice)
        h = ops.linear(x[t], gate_up[e])                                 # (n, 2I) gate | up, recomputed
        act = ops.swiglu(h[:, :I], h[:, I:])                             # (n, I)
        y = ops.linear(act, down[e])                                     # (n, D) the expert's output
        d_weights[t, j] = (d_out[t] * y).sum(axis=-1)                    # out[t] += w[t, j] * y
        d_y = d_out[t] * weights[t, j][:, None]                          # (n, D)
        d_act, d_w = ops.linear_backward(d_y, act, down[e], not frozen)  # (n, I), (D, I)
        d_gate, d_up = ops.swiglu_backward(d_act, h[:, :I], h[:, I:])    # (n, I) each
        d_rows, d_w_gate_up = ops.linear_backward(xp.concatenate([d_gate, d_up], axis=1), x[t], gate_up[e], not frozen)
        if not frozen:
            d_down[e], d_gate_up[e] = d_w, d_w_gate_up                   # (D, I), (2I, D)
        xp.add.at(d_x, t, d_rows)                                        # (n, D) back to each pair's token
    return d_x, d_weights, d_gate_up, d_down


def expert_load(chosen, num_experts: int) -> np.ndarray:
    """How many of the tokens' T*k choices went to each expert: (E,) counts on the host."""
    return to_numpy(xp_of(chosen).bincount(chosen.reshape(-1), minlength=num_experts))
