"""Qwen4-Exp's Per-Layer Embeddings (PLE): for each token, hashed ids of the n-grams that end at it, each
looked up in a large table (transformers' Qwen4ExpTextNGramEmbedding; the PLE layer then convolves them and
adds them to the residual streams, which npqwen does not have yet).

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

import numpy as np

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
