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


def block_keys(keys, blocks, k_norm, cos_all, sin_all, eps: float):
    """Each block's key: the mean of its r raw keys, normalised (1 + weight), rotated to its first token's position.
    keys (S, di) raw, blocks (B, r) positions -> (B, di)."""
    xp = xp_of(keys)
    pooled = keys[xp.asarray(blocks)].astype(np.float32).mean(axis=1).astype(keys.dtype)   # (B, di) the mean raw key
    pooled = ops.rms_norm(pooled, k_norm, eps, 1.0)                             # (B, di), 1 + weight
    start = xp.asarray(blocks[:, 0])                                            # a block sits at its first token
    return ops.apply_rope(pooled[:, None], cos_all[start], sin_all[start])[:, 0]   # (B, di)


def scores_of(q, bkeys):
    """Queries' score of each block: the sum over the indexer heads of relu(q . k) / sqrt(di), in float32.
    q (n, Hi, di), bkeys (B, di) -> (n, B). One product for all n queries; each sum over Hi runs as for one query."""
    xp = xp_of(q)
    n, Hi, di = q.shape
    scores = bkeys.astype(np.float32) @ q.astype(np.float32).reshape(n * Hi, di).T   # (B, n*Hi) q . k
    scores = xp.maximum(scores, 0).reshape(-1, n, Hi).sum(axis=2)                # (B, n) relu, summed over the heads
    return (scores / math.sqrt(di)).T                                            # (n, B)


def block_scores(q, keys, blocks, k_norm, cos_all, sin_all, eps: float):
    """One query's score of each complete block. q (Hi, di), keys (S, di) raw, blocks (B, r) positions -> (B,)."""
    return scores_of(q[None], block_keys(keys, blocks, k_norm, cos_all, sin_all, eps))[0]


def best_blocks(scores, k: int) -> np.ndarray:
    """Each row's k highest scores, best first; of equal scores the earlier block (np.argsort(-scores, kind=
    "stable")'s order; argmax keeps the first maximum, so k passes of it agree, and for QSA's few blocks beat a
    sort). scores (n, B) float32 on the host -> (n, k) block indices."""
    if k > 32:
        return np.argsort(-scores, axis=1, kind="stable")[:, :k]
    scores, best, rows = scores.copy(), np.empty((len(scores), k), dtype=np.int64), np.arange(len(scores))
    for j in range(k):
        best[:, j] = scores.argmax(axis=1)                                      # (n,) the first best left
        scores[rows, best[:, j]] = -np.inf                                      # taken
    return best


def select_tokens(q, keys, visible, k_norm, cos_all, sin_all, budget: int, r: int, eps: float) -> list:
    """For each query, the positions attention may read: its best budget // r blocks, then its last visible
    tokens that fill no block. q (T, Hi, di), keys (S, di) raw, visible (T, S) bool, cos_all / sin_all (S, rot)
    -> T int arrays of positions. Equal scores (relu makes many 0) keep the earlier block; torch.topk leaves
    the order of ties unspecified, so there HF may keep another block of the same score.
    Where each query sees a prefix 0 .. n_t - 1 (a causal sequence, or a chunk of one: all the model makes) the
    blocks are pooled once and scored for every query at once (`select_prefix_tokens`); else query by query."""
    S = visible.shape[1]
    counts = visible.sum(axis=1)                                                # (T,) visible positions
    if (visible == (np.arange(S)[None, :] < counts[:, None])).all():           # (T, S): each a prefix
        return select_prefix_tokens(q, keys, counts, k_norm, cos_all, sin_all, budget, r, eps)
    return select_tokens_each(q, keys, visible, k_norm, cos_all, sin_all, budget, r, eps)


def select_prefix_tokens(q, keys, counts, k_norm, cos_all, sin_all, budget: int, r: int, eps: float) -> list:
    """select_tokens where query t sees positions 0 .. counts[t] - 1: every complete block of the longest is pooled
    once; each chunk of queries scores the blocks its last one sees in one product, a block a query does not see
    whole scores -inf, and the chunk's (n, b) scores go to the host once. Chunks of at most 256 queries (and
    SCORES_BYTES of products) keep a causal prefill's wasted half, the blocks past a query, small.
    q (T, Hi, di), counts (T,) -> T int arrays of positions."""
    T, Hi, _ = q.shape
    whole = np.asarray(counts) // r                                             # (T,) each query's complete blocks
    B = int(whole.max(initial=0))
    blocks = np.arange(B * r).reshape(B, r)                                     # (B, r) positions
    k = min(budget // r, B)
    best = np.zeros((T, k), dtype=np.int64)                                     # (T, k) block indices, best first
    bkeys = block_keys(keys, blocks, k_norm, cos_all, sin_all, eps) if B else None   # (B, di), once
    n = max(1, min(256, ops.SCORES_BYTES // (4 * max(B, 1) * Hi)))             # queries a chunk
    for t in range(0, T, n):
        b = int(whole[t:t + n].max())                                           # blocks this chunk sees
        if b:
            scores = to_numpy(scores_of(q[t:t + n], bkeys[:b]))                 # (n, b) on the host
            scores[np.arange(b)[None, :] >= whole[t:t + n, None]] = -np.inf     # blocks it does not see whole
            best[t:t + n, :min(k, b)] = best_blocks(scores, min(k, b))
    return [np.concatenate([blocks[best[t, :min(k, whole[t])]].reshape(-1),    # its best blocks' positions
                            np.arange(whole[t] * r, counts[t])]) for t in range(T)]   # + the tail


def select_tokens_each(q, keys, visible, k_norm, cos_all, sin_all, budget: int, r: int, eps: float) -> list:
    """select_tokens for any visibility, one query at a time (each pools its own blocks and syncs the host)."""
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
