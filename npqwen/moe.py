"""Qwen3-MoE's sparse MLP: a router sends each token to k of E experts, small SwiGLU MLPs.

Shapes: T tokens, D hidden size, E experts, k experts per token (num_experts_per_tok),
I one expert's width (moe_intermediate_size). Qwen3-30B-A3B: D=2048, E=128, k=8, I=768.

    probs   = softmax(x @ gate^T)                  (T, E), in float32
    chosen  = the k most probable experts of each token, best first (T, k)
    weights = their probabilities (T, k), rescaled to sum 1 when norm_topk_prob
    out[t]  = sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]),  expert_e(x) = down_e(silu(gate_e x) * up_e x)

as transformers' Qwen3MoeSparseMoeBlock computes it. A token runs k of the E experts, so a
layer costs k/E of what its parameters suggest (Qwen3-30B-A3B: 3.3B of 30.5B parameters used
per token). Two pure functions over arrays (NumPy or CuPy): `route`, then `experts`.
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


def expert_load(chosen, num_experts: int) -> np.ndarray:
    """How many of the tokens' T*k choices went to each expert: (E,) counts on the host."""
    return to_numpy(xp_of(chosen).bincount(chosen.reshape(-1), minlength=num_experts))
