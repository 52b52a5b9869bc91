"""Qwen4-Exp's QSA (sparse attention on the full-attention layers): a small learned indexer picks, for each
query, which earlier tokens attention may read, under a token budget (transformers' Qwen4ExpTextQSAIndexer).

The indexer has its own Hi query heads and one key head of width di (index_qk_proj). The visible tokens of a
query are cut into blocks of r = indexer_compress_ratio consecutive tokens; a block's key is the mean of its
tokens' raw keys, RMS-normalised (1 + weight) and rotated to the position of its first token. A block's score
is sum over the indexer heads of relu(q . key) / sqrt(di); the budget // r best blocks are kept, and so are the
last visible tokens that do not fill a whole block. Attention then runs only over the kept tokens
(`selection_mask` AND the causal mask).

What the KV cache keeps for a QSA layer: every position's key and value (as full attention does) and its raw
indexer key (kv_cache.KVCache.index_keys); the selection itself is not kept, as it is each query's own, and is
recomputed from the raw keys (so a prefix-cache hit or a preempted request's recomputation selects the same).

Shapes: T queries, S positions (cached + new), Hi indexer heads, di their width, B = complete blocks of one
query, r tokens per block; H attention heads of Dh, K key/value heads. Checked against transformers' module in
tests/test_qwen4_exp.py; the model (npqwen/qwen4_exp.py) runs `qsa_attention` per sequence.
"""
import math

import numpy as np

from . import lora, ops
from .backend import to_numpy, xp_of


def indexer_queries_keys(x, index_qk_proj, q_norm, Hi: int, di: int, cos, sin, eps: float, loras=(), p: str = ""):
    """The indexer's queries, normalised and rotated, and its raw (un-normalised, un-rotated) keys.
    (T, D) -> q (T, Hi, di), keys (T, di). `loras`: the batch's LoRA adapters (npqwen/lora.py), p the module's name."""
    qk = ops.linear(x, index_qk_proj)                                           # (T, (Hi + 1) * di)
    qk = lora.add(qk, x, loras, p)                                              # + scale * B A x, each adapter's rows
    q, keys = qk[:, :Hi * di].reshape(-1, Hi, di), qk[:, Hi * di:]              # (T, Hi, di), (T, di)
    q = ops.rms_norm(q, q_norm, eps, 1.0)                                       # (T, Hi, di), 1 + weight
    return ops.apply_rope(q, cos, sin), keys


def block_scores(q, keys, blocks, k_norm, cos_all, sin_all, eps: float):
    """One query's score of each complete block. q (Hi, di), keys (S, di) raw, blocks (B, r) positions -> (B,)."""
    xp = xp_of(keys)
    pooled = keys[xp.asarray(blocks)].astype(np.float32).mean(axis=1).astype(keys.dtype)   # (B, di) the mean raw key
    pooled = ops.rms_norm(pooled, k_norm, eps, 1.0)                             # (B, di), 1 + weight
    start = xp.asarray(blocks[:, 0])                                            # a block sits at its first token
    block_keys = ops.apply_rope(pooled[:, None], cos_all[start], sin_all[start])[:, 0]   # (B, di)
    scores = xp.maximum(block_keys.astype(np.float32) @ q.astype(np.float32).T, 0)      # (B, Hi) relu(q . k)
    return scores.sum(axis=1) / math.sqrt(q.shape[-1])                          # (B,) summed over the heads


def select_tokens(q, keys, visible, k_norm, cos_all, sin_all, budget: int, r: int, eps: float) -> list:
    """For each query, the positions attention may read: its best budget // r blocks, then its last visible
    tokens that fill no block. q (T, Hi, di), keys (S, di) raw, visible (T, S) bool, cos_all / sin_all (S, rot)
    -> T int arrays of positions. Equal scores (relu makes many 0) keep the earlier block; torch.topk leaves
    the order of ties unspecified, so there HF may keep another block of the same score."""
    chosen = []
    for t in range(q.shape[0]):
        seen = np.flatnonzero(visible[t])                                       # (n,) this query's visible positions
        B = len(seen) // r                                                      # complete blocks
        blocks = seen[:B * r].reshape(B, r)                                     # (B, r) positions
        picked = np.zeros(0, dtype=np.int64)
        if B:
            scores = to_numpy(block_scores(q[t], keys, blocks, k_norm, cos_all, sin_all, eps))   # (B,) on the host
            best = np.argsort(-scores, kind="stable")[:min(budget // r, B)]     # the highest scores
            picked = blocks[best].reshape(-1)
        chosen.append(np.concatenate([picked, seen[B * r:]]))                  # + the tail that fills no block
    return chosen


def selection_mask(chosen: list, S: int):
    """(T, S) bool: True where query t may read position s."""
    mask = np.zeros((len(chosen), S), dtype=bool)
    for t, positions in enumerate(chosen):
        mask[t, positions] = True
    return mask


def gather_pages(store, table, S: int):
    """One sequence's first S positions out of a layer's pages: (N, K, P, Dh) -> (S, K, Dh), or (N, P, di) ->
    (S, di) for the indexer's keys."""
    P = store.shape[-2]
    pages = store[table[:-(-S // P)]]                                           # (n, [K,] P, d)
    if pages.ndim == 4:
        pages = pages.transpose(0, 2, 1, 3)                                     # (n, P, K, Dh)
    return pages.reshape(-1, *pages.shape[2:])[:S]


def sparse_attention(q, k, v, allowed):
    """Attention that reads only the allowed positions: softmax(q k^T / sqrt(Dh), masked) v, the softmax in float32.
    q (n, H, Dh), k, v (S, K, Dh), allowed (n, S) bool -> (n, H*Dh), probs (H, n, S). Head h reads kv head h // G."""
    xp = xp_of(q)
    n, H, Dh = q.shape
    K = k.shape[1]
    qg = q.reshape(n, K, H // K, Dh).transpose(1, 2, 0, 3)                     # (K, G, n, Dh)
    scores = (qg @ k.transpose(1, 2, 0)[:, None]) * (1.0 / math.sqrt(Dh))      # (K, G, n, S)
    scores = xp.where(xp.asarray(allowed), scores.astype(np.promote_types(q.dtype, np.float32)), -np.inf)
    probs = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = (probs / probs.sum(axis=-1, keepdims=True)).astype(q.dtype)        # (K, G, n, S)
    out = probs @ v.transpose(1, 0, 2)[:, None]                                 # (K, G, n, Dh)
    return out.transpose(2, 0, 1, 3).reshape(n, H * Dh), probs.reshape(H, n, -1)


def sparse_attention_backward(d_out, q, k, v, probs):
    """sparse_attention in reverse, given its probabilities: d_out (n, H*Dh) -> d_q (n, H, Dh), d_k, d_v (S, K, Dh);
    the rule of ops.causal_attention_backward, whose mask is this one's. The selection is a choice, not a function:
    a position it left out has probability 0, so its score gets no gradient (d_s = p (d_p - sum p d_p) is 0 there),
    and nothing flows to the indexer (as in transformers, whose indexer reaches the output only through a boolean
    mask: its weights' .grad stays None)."""
    return ops.causal_attention_backward(d_out, q, k, v, probs)
