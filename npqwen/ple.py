"""Qwen4-Exp's Per-Layer Embeddings (PLE): for each token, hashed ids of the n-grams that end at it, each
looked up in a large table (transformers' Qwen4ExpTextNGramEmbedding); the PLE layer (`ple_layer`,
transformers' Qwen4ExpTextPLELayer) gates them by each residual stream, convolves them over time (dilated) and
adds them to the streams, before the layer's linear attention.

For n = 2 .. ngram_size, the n-gram ending at a token is mixed into one integer by XOR of each of its n
tokens times a fixed odd multiplier (`layer_multipliers`, from SplitMix64 and the layer's seed); a token
further back than the last end-of-text counts as end-of-text (`shift_right_ignore_eos`). That integer, modulo
each of heads_per_ngram primes (`head_vocab_sizes`: one table per head, the primes just above
ngram_vocab_size_base), is the row of that head's table; all the tables are one embedding, head by head.

Shapes: S tokens of one sequence's history (ngram_size - 1 earlier tokens, then the T new ones), n = ngram_size,
Hn = (n - 1) * heads_per_ngram hash heads, d = the width of one head's row. Integer arithmetic is int64, as
torch's long (the multipliers are small enough that token * multiplier never overflows).
"""
import math
from functools import cache

import numpy as np

from . import ops
from .backend import xp_of
from .ops import grouped_rms_norm, grouped_rms_norm_backward

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA, SPLITMIX_M1, SPLITMIX_M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
PRIME_1 = 10007


def splitmix64(value: int) -> int:
    """One step of the SplitMix64 generator on a 64-bit unsigned integer (Python int)."""
    value = (value + SPLITMIX_GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * SPLITMIX_M1) & MASK64
    value = ((value ^ (value >> 27)) * SPLITMIX_M2) & MASK64
    return (value ^ (value >> 31)) & MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> np.ndarray:
    """(n,) int64 odd multipliers, one per place in the n-gram, below 2**63 / vocab_size (so no product overflows)."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + PRIME_1 * ple_layer_index
    return np.array([2 * (splitmix64((base + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half_bound) + 1
                     for i in range(ngram_size)], dtype=np.int64)


def is_prime(n: int) -> bool:
    return n == 2 or (n > 2 and n % 2 == 1 and all(n % d for d in range(3, math.isqrt(n) + 1, 2)))


@cache
def head_vocab_sizes(base: int, heads: int, ple_layer_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Each hash head's table size (the primes after base - 1, continuing across PLE layers) and its first row
    in the shared embedding: ((Hn,), (Hn,)) int64."""
    sizes, prime = [], base - 1
    for _ in range(ple_layer_index * heads):   # the earlier PLE layers' heads took the primes before these
        prime += 1
        while not is_prime(prime):
            prime += 1
    for _ in range(heads):
        prime += 1
        while not is_prime(prime):
            prime += 1
        sizes.append(prime)
    sizes = np.array(sizes, dtype=np.int64)
    return sizes, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def shift_right_ignore_eos(ids, shift: int, eos: int):
    """(S,) -> (S,): the token `shift` places back, or eos where that is before the sequence or before the last
    end-of-text (an n-gram never reaches into the previous document)."""
    if shift == 0:
        return ids
    S = len(ids)
    positions = np.arange(S)
    last_eos = np.maximum.accumulate(np.where(ids == eos, positions, -1))       # (S,) latest eos at or before
    segment_start = np.concatenate([[-1], last_eos[:-1]]) + 1                   # (S,) first token after it
    shifted = ids[np.maximum(positions - shift, 0)]
    valid = (positions - segment_start >= shift) & (positions - shift >= 0)
    return np.where(valid, shifted, eos)


def ngram_ids(history, multipliers, sizes, offsets, heads_per_ngram: int, eos: int):
    """Each token's row in every hash head's table: (S,) int64 history -> (S, Hn), n = 2 .. ngram_size in turn."""
    shifted = [shift_right_ignore_eos(history, s, eos) for s in range(len(multipliers))]   # n arrays (S,)
    blocks = []
    for n in range(2, len(multipliers) + 1):
        mixed = shifted[0] * multipliers[0]                                     # (S,)
        for place in range(1, n):
            mixed = mixed ^ (shifted[place] * multipliers[place])               # XOR of token * multiplier
        heads = slice((n - 2) * heads_per_ngram, (n - 1) * heads_per_ngram)
        blocks.append(np.remainder(mixed[:, None], sizes[heads]) + offsets[heads])   # (S, heads_per_ngram)
    return np.concatenate(blocks, axis=1)                                       # (S, Hn)


def ngram_embedding(table, token_ids, previous, multipliers, sizes, offsets, heads_per_ngram: int, eos: int):
    """The T new tokens' hashed n-gram embeddings: each head's row, side by side. `previous`: the sequence's
    ngram_size - 1 tokens before these (eos at its start). (rows, d) table -> (T, Hn*d)."""
    history = np.concatenate([np.asarray(previous, dtype=np.int64), np.asarray(token_ids, dtype=np.int64)])
    ids = ngram_ids(history, multipliers, sizes, offsets, heads_per_ngram, eos)[-len(token_ids):]   # (T, Hn)
    return table[ids].reshape(len(token_ids), -1)                               # (T, Hn*d)


def hash_constants(config, ple_layer_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One PLE layer's hashing: its n multipliers (a GGUF's as stored, else from the seed) and its Hn heads'
    table sizes and first rows: ((n,), (Hn,), (Hn,)) int64."""
    Hn = (config.ngram_size - 1) * config.heads_per_ngram
    multipliers = (np.array(config.ple_multipliers, dtype=np.int64) if config.ple_multipliers
                   else layer_multipliers(config.vocab_size, config.ngram_size, ple_layer_index, config.seed))
    return (multipliers, *head_vocab_sizes(config.ngram_vocab_size_base, Hn, ple_layer_index))


def hf_buffers(config) -> dict[str, np.ndarray]:
    """The hash constants transformers keeps as persistent buffers of each PLE layer and writes beside its table
    (save_pretrained), by HF name, int64: npqwen computes them (hash_constants) and writes them for transformers."""
    buffers = {}
    for i in range(config.num_hidden_layers):
        if config.is_ple_layer(i):
            q = f"model.layers.{i}.ple.ple_embedding"
            multipliers, sizes, offsets = hash_constants(config, config.ple_index(i))
            buffers.update({f"{q}.layer_multipliers": multipliers, f"{q}.ngram_heads_vocab_sizes": sizes,
                            f"{q}.ngram_heads_offsets": offsets})
    return buffers


def table_rows(config, ple_layer_index: int) -> int:
    """Rows of one PLE layer's table: its Hn heads' primes, added, rounded up to a multiple of
    make_ngram_vocab_size_divisible_by."""
    Hn = (config.ngram_size - 1) * config.heads_per_ngram
    sizes, _ = head_vocab_sizes(config.ngram_vocab_size_base, Hn, ple_layer_index)
    div = config.make_ngram_vocab_size_divisible_by
    return -(-int(sizes.sum()) // div) * div


class NgramTable:
    """One PLE layer's n-gram table, left on disk: the checkpoint's shards (ngram_embedding.shard_0.weight, ...,
    each a run of rows), memory-mapped; only the rows a batch looks up are read. (rows, d) like the HF weight."""

    def __init__(self, parts: list, widen=None):
        self.parts = parts                                          # [(rows_j, d)] mapped arrays, in order
        self.starts = np.cumsum([0] + [len(p) for p in parts])      # (J + 1,) first row of each part
        self.shape = (int(self.starts[-1]), parts[0].shape[1])
        self.widen = widen or (lambda rows: np.asarray(rows, dtype=np.float32))   # stored bits -> float32
        self.dtype = np.dtype(np.float32)

    def __getitem__(self, ids):
        """ids (...) int64 -> (..., d) float32: each row read from the part that holds it."""
        flat = np.asarray(ids).reshape(-1)
        part = np.searchsorted(self.starts, flat, side="right") - 1             # (n,) which part holds each row
        out = np.empty((len(flat), self.shape[1]), dtype=np.float32)
        for j in np.unique(part):
            at = part == j
            out[at] = self.widen(self.parts[j][flat[at] - self.starts[j]])
        return out.reshape(*np.shape(ids), self.shape[1])

    @property
    def nbytes(self) -> int:   # on disk, not in memory
        return sum(p.nbytes for p in self.parts)


def dilated_causal_conv(x, kernel, state, dilation: int):
    """A depthwise convolution over time, each output reading the inputs `dilation` apart, causal: out[t] =
    sum_k kernel[:, k] * inputs[t + k * dilation] over the last L = (K-1) * dilation inputs before t and t's own.
    x (T, CD), kernel (CD, K), state (L, CD) the inputs before these -> (T, CD), the new state (L, CD)."""
    xp = xp_of(x)
    T = x.shape[0]
    inputs = xp.concatenate([state.astype(x.dtype), x])                     # (L + T, CD)
    out = xp.zeros_like(x)
    for k in range(kernel.shape[1]):
        out += kernel[:, k] * inputs[k * dilation:k * dilation + T]          # (T, CD)
    return out, inputs[T:]                                                   # the last L inputs


def dilated_causal_conv_backward(d_out, x, kernel, state, dilation: int):
    """out[t] = sum_k kernel[:, k] * inputs[t + k * dilation]: d_out (T, CD) -> d_x (T, CD), d_kernel (CD, K) (the
    state's gradient is not taken: a backward runs from position 0, whose state is zeros)."""
    xp, T, L = xp_of(x), x.shape[0], state.shape[0]
    inputs = xp.concatenate([state.astype(x.dtype), x])                     # (L + T, CD)
    d_inputs = xp.zeros_like(inputs)
    d_kernel = xp.empty_like(kernel)
    for k in range(kernel.shape[1]):
        d_inputs[k * dilation:k * dilation + T] += kernel[:, k] * d_out      # (T, CD)
        d_kernel[:, k] = (d_out * inputs[k * dilation:k * dilation + T]).sum(axis=0)
    return d_inputs[L:], d_kernel


def ple_layer(x, emb, W: dict, p: str, C: int, conv_state, dilation: int, eps: float, projected=None):
    """What a PLE layer adds to the C streams (transformers' Qwen4ExpTextPLELayer.forward). x (T, C*D) the streams,
    emb (T, E) the tokens' n-gram embeddings -> (T, C*D), and the convolution's new state (L, C*D).
    Each stream c asks with its normalised values (a query) how much of the shared value to take: the gate is the
    signed square root of its scaled dot product with the embedding's key for stream c. `projected`: key_proj(emb)
    (T, C*D) and value_proj(emb) (T, D) when the caller made them (the model, adding a LoRA adapter's updates)."""
    T, D = x.shape[0], x.shape[1] // C
    if projected is None:
        projected = ops.linear(emb, W[f"{p}.key_proj.weight"]), ops.linear(emb, W[f"{p}.value_proj.weight"])
    key, value = projected                                                                               # (T, C*D), (T, D)
    key = grouped_rms_norm(key, W[f"{p}.norm_key.weight"], D, eps)                                       # (T, C*D)
    query = grouped_rms_norm(x, W[f"{p}.norm_query.weight"], D, eps)                                      # (T, C*D)
    gate = (key.reshape(T, C, D) * query.reshape(T, C, D)).sum(-1, keepdims=True) / math.sqrt(D)        # (T, C, 1)
    gate = xp_of(x).sqrt(xp_of(x).maximum(abs(gate), 1e-6)) * xp_of(x).sign(gate)   # signed sqrt, as HF's
    gated = (ops.sigmoid(gate) * value[:, None, :]).reshape(T, C * D)                # (T, C*D): each stream's share
    normed = grouped_rms_norm(gated, W[f"{p}.norm_conv.weight"], D, eps)             # (T, C*D)
    conv, state = dilated_causal_conv(normed, W[f"{p}.conv1d.weight"][:, 0], conv_state, dilation)
    return gated + ops.silu(conv), state                                             # (T, C*D)


def ple_layer_backward(d_out, x, emb, W: dict, p: str, C: int, dilation: int, eps: float, projected=None,
                       linear_backward=None):
    """ple_layer in reverse, from position 0 (a zero convolution state): d_out (T, C*D) -> d_x (T, C*D) (through the
    query), d_emb (T, E) (the looked-up rows' gradient; the tables themselves get none: they stay frozen on disk),
    and the layer's weights' gradients by HF name. Recomputes the forward's steps; `projected` as ple_layer's.
    `linear_backward(d_y, x, weight, name) -> (d_x, d_weight or None)`: key_proj's and value_proj's backward (by
    default ops.linear_backward; npqwen/grad.py's adds a LoRA adapter's path and keeps its gradients)."""
    xp, (T, CD), D = xp_of(x), x.shape, x.shape[1] // C
    linear_backward = linear_backward or (lambda d_y, a, weight, name: ops.linear_backward(d_y, a, weight))
    # the forward again: key, value, query, the signed-sqrt gate, the gated value, its norm and convolution
    if projected is None:
        projected = ops.linear(emb, W[f"{p}.key_proj.weight"]), ops.linear(emb, W[f"{p}.value_proj.weight"])
    k_in, value = projected                                                              # (T, C*D), (T, D)
    key = grouped_rms_norm(k_in, W[f"{p}.norm_key.weight"], D, eps).reshape(T, C, D)
    query = grouped_rms_norm(x, W[f"{p}.norm_query.weight"], D, eps).reshape(T, C, D)
    score = (key * query).sum(-1, keepdims=True) / math.sqrt(D)                          # (T, C, 1)
    gate = xp.sqrt(xp.maximum(abs(score), 1e-6)) * xp.sign(score)
    gated = (ops.sigmoid(gate) * value[:, None, :]).reshape(T, CD)                       # (T, C*D)
    normed = grouped_rms_norm(gated, W[f"{p}.norm_conv.weight"], D, eps)
    kernel = W[f"{p}.conv1d.weight"][:, 0]                                               # (C*D, K)
    state = xp.zeros(((kernel.shape[1] - 1) * dilation, CD), dtype=x.dtype)              # (L, C*D)
    conv, _ = dilated_causal_conv(normed, kernel, state, dilation)
    # out = gated + silu(conv(norm_conv(gated)))
    d_conv = ops.silu_backward(d_out, conv)                                              # (T, C*D)
    d_normed, d_kernel = dilated_causal_conv_backward(d_conv, normed, kernel, state, dilation)
    d_gated, d_norm_conv = grouped_rms_norm_backward(d_normed, gated, W[f"{p}.norm_conv.weight"], D, eps)
    d_gated = (d_gated + d_out).reshape(T, C, D)
    # gated = sigmoid(gate) * value: value is shared by the streams, the gate is each stream's
    d_value = (d_gated * ops.sigmoid(gate)).sum(axis=1)                                  # (T, D)
    d_gate = ops.sigmoid_backward((d_gated * value[:, None, :]).sum(-1, keepdims=True), gate)   # (T, C, 1)
    # gate = sign(score) sqrt(max(|score|, 1e-6)): slope 1 / (2 sqrt|score|), 0 where the clamp holds it
    d_score = xp.where(abs(score) >= 1e-6, d_gate * 0.5 / xp.sqrt(xp.maximum(abs(score), 1e-6)), 0.0) / math.sqrt(D)
    d_key, d_query = (d_score * query).reshape(T, CD), (d_score * key).reshape(T, CD)    # (T, C*D) each
    d_x, d_norm_query = grouped_rms_norm_backward(d_query, x, W[f"{p}.norm_query.weight"], D, eps)
    d_k_in, d_norm_key = grouped_rms_norm_backward(d_key, k_in, W[f"{p}.norm_key.weight"], D, eps)
    d_emb_k, d_key_proj = linear_backward(d_k_in, emb, W[f"{p}.key_proj.weight"], f"{p}.key_proj")   # (T, E), (C*D, E)
    d_emb_v, d_value_proj = linear_backward(d_value, emb, W[f"{p}.value_proj.weight"], f"{p}.value_proj")   # (D, E)
    grads = {f"{p}.key_proj.weight": d_key_proj, f"{p}.value_proj.weight": d_value_proj,
             f"{p}.norm_key.weight": d_norm_key, f"{p}.norm_query.weight": d_norm_query,
             f"{p}.norm_conv.weight": d_norm_conv, f"{p}.conv1d.weight": d_kernel[:, None, :]}
    return d_x, d_emb_k + d_emb_v, grads
