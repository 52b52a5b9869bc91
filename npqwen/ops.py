"""The operators of Qwen3, as small pure functions over arrays (NumPy or CuPy).

Shapes: T tokens in this call, S positions attended (cached + new), D hidden size,
H query heads, K key/value heads, G = H / K, Dh head dim, F MLP width, V vocab size.

Every function keeps its input's dtype (float32 on CPU). Scalars are Python floats: NumPy 2
turns `float32_array * np.float64(...)` into float64, which silently makes matmuls ~200x slower.

Each operator's backward sits right after it, named after it (`rms_norm_backward`): given d_out, the
gradient of a scalar with respect to the operator's output, and what the forward was given, it returns
the gradients with respect to the inputs, in the same shapes (npqwen/grad.py chains them through the
model; tests/test_backward.py checks each against finite differences in float64 and torch autograd).
"""
import math

import numpy as np

from .backend import xp_of
from .errors import NpqwenError
from .weights import FEW_ROWS, is_compact, small_products


def embed(weight, token_ids, first: int = 0):
    """Row lookup: one D-vector per token. Under tensor parallelism `weight` holds the vocabulary's
    rows first .. first + len(weight) - 1 only, and a token outside them gets zeros (the rank that
    holds it adds its row; in one process every token is inside). A compact weight (npqwen/weights.py)
    widens only the rows looked up."""
    xp = xp_of(token_ids)
    local = token_ids - first                                            # (T,) rows of this shard
    inside = xp.logical_and(local >= 0, local < weight.shape[0])         # (T,) all True in one process
    rows = xp.where(inside, local, 0)
    x = weight.take(rows) if is_compact(weight) else weight[rows]        # (V/N, D)[(T,)] -> (T, D)
    x *= inside[:, None]                                                 # zeros for other ranks' tokens
    return x


def embed_backward(d_x, token_ids, vocab_size: int):
    """d weight (V, D): each token's gradient added to its row; a token that occurs twice gets both (add.at).
    (One process: the tensor-parallel `first` is not taken.)"""
    xp = xp_of(d_x)
    d_weight = xp.zeros((vocab_size, d_x.shape[1]), dtype=d_x.dtype)    # (V, D)
    xp.add.at(d_weight, token_ids, d_x)                                  # rows[(T,)] += (T, D)
    return d_weight


def linear(x, weight):
    """x @ weight^T, weight in the HF (out, in) layout; (T, in) -> (T, out), row-major.

    For up to 128 rows (decode steps) it is computed as (weight @ x^T)^T and copied back to
    row-major: OpenBLAS runs the product 1.2-1.4x faster that way round (measured at 8-128
    rows), and the copy is small. For more rows (prefill chunks) the gain is under 10% and
    copying the transposed result back would eat it, so x @ weight^T it is. (The steps after
    a linear layer, QK-norm, RoPE, SiLU, run several times slower over a transposed array.)
    A compact weight (bfloat16, int8, Q4_K... npqwen/weights.py) computes the same product itself,
    widening a block of its rows at a time.
    """
    if is_compact(weight):
        return weight.linear(x)                       # (T, in) -> (T, out), in float32
    if x.shape[0] > 128:
        return x @ weight.T                           # (T, in) @ (in, out) -> (T, out)
    if 2 <= x.shape[0] <= FEW_ROWS and xp_of(x) is np:
        return few_rows_linear(x, weight)
    y = weight @ x.T                                  # (out, in) @ (in, T) -> (out, T)
    return xp_of(y).ascontiguousarray(y.T)            # (T, out)


def few_rows_linear(x, weight):
    """(weight @ x^T)^T for a few rows x (T, in), weight (out, in), in blocks of its rows (weights.small_products):
    (T, in) -> (T, out)."""
    y = np.empty((weight.shape[0], x.shape[0]), dtype=np.result_type(x, weight))   # (out, T)
    small_products(weight, x, y)
    return np.ascontiguousarray(y.T)                                       # (T, out)


def linear_backward(d_y, x, weight, want_weight: bool = True):
    """y = x @ weight^T: d_x = d_y @ weight (T, in), d_weight = d_y^T @ x (out, in), the HF layout (None when
    not wanted). d_x is computed as (weight^T @ d_y^T)^T: with two threads OpenBLAS runs lm_head's product (inner
    dimension V) 3x faster that way round (measured at T=256, V=151936, D=1024: 1.7-2.0 s against 5.4 s, twice;
    with one thread both take 1.9-2.5 s, and the layers' shapes the same either way)."""
    if is_compact(weight):   # a frozen compact base (QLoRA): it widens a block of rows at a time, as in linear
        if want_weight:
            raise NpqwenError(f"a compact weight ({weight.format}) is frozen and has no gradient; load the model with "
                              f"weights='float32' for the weights' gradients, or ask for none (weights=False)")
        return weight.linear_backward(d_y), None                        # (T, out) -> (T, in)
    d_x = xp_of(d_y).ascontiguousarray((weight.T @ d_y.T).T)           # (in, out) @ (out, T) -> (T, in)
    return d_x, (d_y.T @ x if want_weight else None)                    # (out, T) @ (T, in)


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over the last axis, in (at least) float32 as HF does.
    Qwen3.5 stores its norm weights centred on zero and scales by 1 + weight (offset 1)."""
    xp = xp_of(x)
    xf = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
    mean_square = xp.einsum("...d,...d->...", xf, xf)[..., None] / x.shape[-1]   # (..., 1)
    inv_rms = 1.0 / xp.sqrt(mean_square + eps)
    y = (xf * inv_rms).astype(x.dtype, copy=False)                           # (..., D)
    y *= weight if not offset else weight + offset
    return y


def rms_norm_backward(d_y, x, weight, eps: float, offset: float = 0.0):
    """y = n * (offset + weight), n = x * r, r = 1 / sqrt(mean(x^2) + eps):
    d_x = r * (d_n - n * mean(d_n * n)), d_n = d_y * (offset + weight); d_weight = sum of d_y * n over
    every axis but the last. x (..., D) -> d_x (..., D), d_weight (D,)."""
    xp = xp_of(x)
    inv_rms = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)     # (..., 1)
    n = x * inv_rms                                                          # (..., D) normalised
    d_weight = (d_y * n).reshape(-1, x.shape[-1]).sum(axis=0)                # (D,)
    d_n = d_y * (weight + offset if offset else weight)                      # (..., D)
    d_x = inv_rms * (d_n - n * (d_n * n).mean(axis=-1, keepdims=True))      # (..., D)
    return d_x, d_weight


def grouped_rms_norm(x, weight, group: int, eps: float):
    """Qwen4-Exp's hc_norm and PLE's norms: each stream's D values normalised on their own, then scaled by 1 + weight (float32 inside, as HF;
    float64 stays float64). (T, C*D), (C*D,) -> (T, C*D)."""
    f32 = np.promote_types(x.dtype, np.float32)
    h = x.astype(f32).reshape(x.shape[0], x.shape[1] // group, group)           # (T, C, D)
    h = h / xp_of(x).sqrt(xp_of(x).mean(h * h, axis=-1, keepdims=True) + eps)   # (T, C, D)
    return (h.reshape(x.shape) * (1.0 + weight.astype(f32))).astype(x.dtype)    # (T, C*D)


def grouped_rms_norm_backward(d_y, x, weight, group: int, eps: float):
    """y = n * (1 + weight), n = each stream's x / rms: d_x = r * (d_n - n * mean(d_n * n)) per stream (rms_norm_
    backward's rule), d_weight = sum over tokens of d_y * n. (T, C*D) -> d_x (T, C*D), d_weight (C*D,)."""
    xp, (T, CD) = xp_of(x), x.shape
    h = x.reshape(T, CD // group, group)                                         # (T, C, D)
    inv_rms = 1.0 / xp.sqrt((h * h).mean(axis=-1, keepdims=True) + eps)         # (T, C, 1)
    n = h * inv_rms                                                             # (T, C, D) normalised
    d_n = (d_y * (1.0 + weight)).reshape(h.shape)                               # (T, C, D)
    d_x = inv_rms * (d_n - n * (d_n * n).mean(axis=-1, keepdims=True))          # (T, C, D)
    return d_x.reshape(T, CD), (d_y * n.reshape(T, CD)).sum(axis=0)


def sigmoid(x):
    """1 / (1 + exp(-x)) = (1 + tanh(x/2)) / 2, which never overflows."""
    return (xp_of(x).tanh(x * 0.5) + 1.0) * 0.5


def sigmoid_backward(d_y, x):
    """d sigmoid(x) / dx = s (1 - s)."""
    s = sigmoid(x)
    return d_y * s * (1.0 - s)


def silu(x):
    """x * sigmoid(x), with sigmoid(x) = (1 + tanh(x/2)) / 2, which never overflows."""
    xp = xp_of(x)
    s = x * 0.5
    xp.tanh(s, out=s)      # in place: these temporaries are as large as the MLP's activations
    s *= 0.5
    s += 0.5
    s *= x
    return s


def silu_backward(d_y, x):
    """d (x s) / dx = s + x s (1 - s) = s (1 + x (1 - s)), s = sigmoid(x)."""
    s = sigmoid(x)
    return d_y * s * (1.0 + x * (1.0 - s))


def rope_frequencies(config) -> tuple[np.ndarray, float]:
    """Inverse frequencies theta^(-2i/Dh), i < Dh/2, and the cos/sin scale, as transformers computes them.

    "linear" divides every frequency by `factor`; "yarn" interpolates the low frequencies
    (long wavelengths) and keeps the high ones, then scales cos/sin by 0.1 ln(factor) + 1.
    Computed in float32 on the host, like HF's torch code.
    """
    dim, base = config.rotary_dim, config.rope_theta   # rotary_dim: Dh, or the part of it Qwen3.5 turns
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))   # (Dh/2,)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if config.rope_type == "yarn":
        return _yarn(pos_freqs, inv_freq, dim, base, scaling)
    return inv_freq, 1.0


def _yarn(pos_freqs, inv_freq, dim, base, scaling) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071) exactly as transformers' _compute_yarn_parameters."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):   # the dimension whose wavelength fits `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolate = (1 - ramp).astype(np.float32)          # 1: keep the frequency, 0: divide it by factor
    interpolated = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (interpolated * (1 - extrapolate) + inv_freq * extrapolate).astype(np.float32), float(attention_factor)


def rope_cos_sin(inv_freq, positions, scale: float, dtype):
    """cos and sin tables for `positions`, both halves equal (HF's cat(freqs, freqs))."""
    xp = xp_of(inv_freq)
    angles = positions.astype(xp.float32)[:, None] * inv_freq[None, :]       # (T, Dh/2), float32
    angles = xp.concatenate([angles, angles], axis=-1)                       # (T, Dh)
    return (xp.cos(angles) * scale).astype(dtype), (xp.sin(angles) * scale).astype(dtype)


def apply_rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]: each pair (x[j], x[j + Dh/2]) turns
    by its position's angle. Qwen3 (HF) rotates split halves, not llama's interleaved (x[2j], x[2j+1])."""
    if cos.shape[-1] < x.shape[-1]:   # partial rotary (Qwen3.5): the first cos.shape[-1] values turn, the rest pass
        out = x.copy()
        out[..., :cos.shape[-1]] = apply_rope(x[..., :cos.shape[-1]], cos, sin)
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]                 # (T, n_heads, Dh/2) each
    s = sin[:, None, :half]                               # (T, 1, Dh/2): both halves of sin are equal
    out = x * cos[:, None, :]                             # (T, n_heads, Dh)
    rotated = x2 * s
    out[..., :half] -= rotated                            # x1 cos - x2 sin
    xp_of(x).multiply(x1, s, out=rotated)
    out[..., half:] += rotated                            # x2 cos + x1 sin
    return out


def apply_rope_backward(d_out, cos, sin):
    """RoPE turns each pair (x1, x2) by an angle; its transpose turns it back: the same function with -sin.
    d_out (T, n_heads, Dh) -> d_x (T, n_heads, Dh); partial rotary's unturned values pass their gradient."""
    return apply_rope(d_out, cos, -sin)


SCORES_BYTES = 128 * 2**20   # the most one block of paged_attention's scores takes: 256 queries x 16 heads x 8k keys


def paged_attention(q, keys, values, page_table, start: int, block: int = 256, want_probs: bool = False):
    """Causal grouped-query attention of one sequence whose keys and values live in pages:
    softmax(q k^T / sqrt(Dh) + mask) v.

    q: (T, H, Dh) queries at positions start .. start + T - 1. keys, values: (N, K, P, Dh), a
    layer's whole page store; page_table[j] is the page that holds this sequence's positions
    j*P .. j*P + P - 1, for every position 0 .. S - 1, S = start + T (the new tokens' keys are
    already written). Query head h reads key/value head h // G (HF's repeat_kv order 0,0,1,1,...).
    Returns the output (T, H*Dh), and with want_probs the probabilities (H, T, S) too (zero
    where the mask hides the future).

    How the pages are read: the G query heads of a key/value head are one matrix of G*Tb rows,
    so each page takes one product per key/value head, straight from the store (a page is a
    contiguous (K, P, Dh) block), written into its columns of one (K, G*Tb, S) score array; one
    softmax over its contiguous last axis; then the weighted values, again one product per page,
    summed. Gathering the pages into one array first would copy every cached key and value at
    every step. Queries go in blocks of `block`: a block needs keys only up to its own last
    position, so much of the masked upper triangle is never computed, and only the block's own
    last Tb columns need the causal mask. (Measured in a 1024-token prefill: blocks of 256 beat 64,
    128 and 512.) A block's scores are (H, Tb, S) float32: past 8k keys (16 heads) the block shrinks so that
    they stay under SCORES_BYTES, and a long prompt's scratch does not grow with its length.
    Compact pages (kv_cache.CompactPages) are widened one page at a time as they are read here.
    """
    xp = xp_of(q)
    T, H, Dh = q.shape
    K, P = keys.shape[1], keys.shape[2]
    G = H // K
    block = max(1, min(block, SCORES_BYTES // (H * (start + T) * 4)))   # (H, Tb, S) float32 under SCORES_BYTES
    q = (q * (1.0 / math.sqrt(Dh))).reshape(T, K, G, Dh).transpose(1, 2, 0, 3)   # (K, G, T, Dh), scaled once
    softmax_dtype = np.promote_types(q.dtype, np.float32)
    out = xp.empty((T, H * Dh), dtype=q.dtype)
    probs = xp.zeros((H, T, start + T), dtype=q.dtype) if want_probs else None
    for b in range(0, T, block):
        end = min(b + block, T)
        n, S = end - b, start + end                      # queries in this block, keys they see
        pages = [(int(page_table[j]), j * P, min(P, S - j * P)) for j in range(-(-S // P))]  # (page, first, filled)
        qb = q[:, :, b:end].reshape(K, G * n, Dh)       # rows (g, t) of key/value head j: query heads j*G + g
        scores = xp.empty((K, G * n, S), dtype=q.dtype)                                 # (K, G*Tb, S)
        for page, first, w in pages:
            xp.matmul(qb, keys[page, :, :w].transpose(0, 2, 1), out=scores[:, :, first:first + w])  # @ (K, Dh, w)
        scores = scores.astype(softmax_dtype, copy=False)                              # softmax in float32
        if n > 1:   # query t of the block is at position S - n + t: the keys after it are in the last n columns
            future = xp.triu(xp.full((n, n), -np.inf, dtype=scores.dtype), 1)          # (Tb, Tb)
            scores.reshape(K, G, n, S)[..., S - n:] += future
        # softmax(scores) @ v, normalised after the product: (w @ v) / sum(w) with w = exp(scores - max)
        scores -= scores.max(axis=-1, keepdims=True)
        e = xp.exp(scores, out=scores)                                                 # unnormalised weights
        total = e.sum(axis=-1, keepdims=True)                                          # (K, G*Tb, 1)
        e_v = e.astype(q.dtype, copy=False)
        o = None
        for page, first, w in pages:
            part = e_v[:, :, first:first + w] @ values[page, :, :w]                    # (K, G*Tb, w) @ (K, w, Dh)
            o = part if o is None else xp.add(o, part, out=o)                          # (K, G*Tb, Dh)
        o /= total.astype(q.dtype, copy=False)
        out[b:end] = o.reshape(K, G, n, Dh).transpose(2, 0, 1, 3).reshape(n, H * Dh)
        if want_probs:   # a copy, normalised; the output above does not read it
            probs[:, b:end, :S] = (e / total).reshape(H, n, S)
    return out, probs


def causal_attention(q, k, v):
    """paged_attention's result for one sequence from position 0, with every array whole, as training reads
    it: q (T, H, Dh), k, v (T, K, Dh) -> out (T, H*Dh), probs (H, T, T). Query head h reads kv head h // G."""
    xp = xp_of(q)
    T, H, Dh = q.shape
    K = k.shape[1]
    qg = q.reshape(T, K, H // K, Dh).transpose(1, 2, 0, 3)                   # (K, G, T, Dh)
    scores = (qg @ k.transpose(1, 2, 0)[:, None]) * (1.0 / math.sqrt(Dh))   # (K, G, T, T)
    scores = scores.astype(np.promote_types(q.dtype, np.float32), copy=False)
    scores = scores + xp.triu(xp.full((T, T), -np.inf, dtype=scores.dtype), 1)   # a query sees keys <= it
    probs = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = (probs / probs.sum(axis=-1, keepdims=True)).astype(q.dtype)      # (K, G, T, T)
    out = probs @ v.transpose(1, 0, 2)[:, None]                               # (K, G, T, Dh)
    return out.transpose(2, 0, 1, 3).reshape(T, H * Dh), probs.reshape(H, T, T)


def causal_attention_backward(d_out, q, k, v, probs):
    """Backward of softmax(q k^T / sqrt(Dh) + mask) v, given the probabilities the forward computed.
    d_out (T, H*Dh) -> d_q (T, H, Dh), d_k, d_v (S, K, Dh) (S = T from position 0): a key/value head's gradient
    is the sum over the G query heads that read it. Softmax backward: d_s = p * (d_p - sum_j d_p p); masked p are
    0, so are their d_s (any mask: QSA's selection too, npqwen/qsa.py)."""
    T, H, Dh = q.shape
    K = k.shape[1]
    G = H // K
    p = probs.reshape(K, G, T, -1)                                           # (K, G, T, S)
    d_o = d_out.reshape(T, K, G, Dh).transpose(1, 2, 0, 3)                   # (K, G, T, Dh)
    qg = q.reshape(T, K, G, Dh).transpose(1, 2, 0, 3)                        # (K, G, T, Dh)
    kh, vh = k.transpose(1, 0, 2)[:, None], v.transpose(1, 0, 2)[:, None]    # (K, 1, S, Dh)
    d_v = (p.transpose(0, 1, 3, 2) @ d_o).sum(axis=1)                        # (K, S, Dh) summed over G
    d_p = d_o @ vh.transpose(0, 1, 3, 2)                                     # (K, G, T, S)
    d_s = p * (d_p - (d_p * p).sum(axis=-1, keepdims=True)) * (1.0 / math.sqrt(Dh))   # (K, G, T, S)
    d_q = (d_s @ kh).transpose(2, 0, 1, 3).reshape(T, H, Dh)                 # (T, H, Dh)
    d_k = (d_s.transpose(0, 1, 3, 2) @ qg).sum(axis=1)                       # (K, S, Dh) summed over G
    return d_q, d_k.transpose(1, 0, 2), d_v.transpose(1, 0, 2)


def paged_decode_attention(q, keys, values, page_tables, lengths, want_probs: bool = False):
    """paged_attention for B sequences with one new token each (a decode step), all at once.

    q: (B, H, Dh), sequence b's token at position lengths[b] - 1, which sees positions
    0 .. lengths[b] - 1 (nothing after it exists, so there is no causal mask, only the empty
    tail of each last page). The products go one page at a time, straight from the store:
    each key/value head's G query rows against the page's keys ((K, G, Dh) @ (K, Dh, w)), written
    into the page's columns of one (B, K, G, pages * P) score array, so the softmax runs once per
    layer over a contiguous last axis; then the weighted values page by page ((K, G, w) @ (K, w, Dh)).
    (Measured on one core over 4,096 cached positions, against the keys as the left operand: one
    layer's decode attention 1.3-1.4x faster at Qwen3.5's 2 heads of 256, up to 1.2x at Qwen3's 8 of 128.)
    Returns the output (B, H*Dh), and with want_probs the probabilities (B, H, S) too,
    S = max(lengths) (zero past a sequence's length).
    """
    xp = xp_of(q)
    B, H, Dh = q.shape
    K, P = keys.shape[1], keys.shape[2]
    G = H // K
    q = (q * (1.0 / math.sqrt(Dh))).reshape(B, K, G, Dh)                       # (B, K, G, Dh), scaled once
    n_pages = [-(-S // P) for S in lengths]
    M = max(n_pages)
    scores = xp.full((B, K, G, M * P), -np.inf, dtype=q.dtype)                   # -inf: positions a sequence lacks
    for b, (table, S) in enumerate(zip(page_tables, lengths)):
        for j in range(n_pages[b]):
            w = min(P, S - j * P)
            page_keys = keys[int(table[j]), :, :w].transpose(0, 2, 1)                # (K, Dh, w)
            xp.matmul(q[b], page_keys, out=scores[b, :, :, j * P:j * P + w])         # (K, G, Dh) @ (K, Dh, w)
    scores = scores.astype(np.promote_types(q.dtype, np.float32), copy=False)        # softmax in float32
    scores -= scores.max(axis=-1, keepdims=True)
    e = xp.exp(scores, out=scores)                                                   # unnormalised weights
    total = e.sum(axis=-1)                                                           # (B, K, G)
    e_v = e.astype(q.dtype, copy=False)
    o = xp.empty((B, K, G, Dh), dtype=q.dtype)
    for b, (table, S) in enumerate(zip(page_tables, lengths)):
        for j in range(n_pages[b]):
            w = min(P, S - j * P)
            part = e_v[b, :, :, j * P:j * P + w] @ values[int(table[j]), :, :w]       # (K, G, w) @ (K, w, Dh)
            if j == 0:
                o[b] = part
            else:
                o[b] += part
    o = o / total[..., None].astype(q.dtype, copy=False)                            # (B, K, G, Dh)
    probs = None
    if want_probs:   # a copy, normalised; the output above does not read it
        probs = (e / total[..., None]).astype(q.dtype).reshape(B, H, M * P)[:, :, :max(lengths)]
    return o.reshape(B, H * Dh), probs                                              # heads in order j*G + g


def swiglu(gate, up):
    """silu(gate) * up, the MLP's activation: (T, F), (T, F) -> (T, F)."""
    return silu(gate) * up


def swiglu_backward(d_h, gate, up):
    """h = silu(gate) * up: d_gate = silu'(gate) * up * d_h, d_up = silu(gate) * d_h."""
    return silu_backward(d_h * up, gate), silu(gate) * d_h


def log_softmax(logits):
    """log softmax over the last axis, in (at least) float32: (T, V) -> (T, V), one new (T, V) array besides a
    temporary (the logits of a long prompt are the largest arrays of a training step)."""
    xp = xp_of(logits)
    z = logits.astype(np.promote_types(logits.dtype, np.float32), copy=True)
    z -= z.max(axis=-1, keepdims=True)
    z -= xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    return z


def cross_entropy(logits, targets, ignore_index: int = -100):
    """Mean of -log p(target) over the rows whose target is not ignore_index (HF's loss): (T, V), (T,) -> float."""
    xp = xp_of(logits)
    keep = targets != ignore_index                                           # (T,)
    logp = log_softmax(logits[keep])                                         # (n, V)
    picked = xp.take_along_axis(logp, targets[keep][:, None], axis=-1)      # (n, 1)
    return float(-picked.mean())


def cross_entropy_backward(logits, targets, ignore_index: int = -100, logp=None):
    """d loss / d logits = (softmax - one_hot(target)) / n on the counted rows, 0 on ignored ones: (T, V).
    `logp`: log_softmax(logits) if the caller has it, used up (overwritten) in place of a new array."""
    xp = xp_of(logits)
    keep = targets != ignore_index                                           # (T,)
    n = max(int(keep.sum()), 1)
    d = xp.exp(log_softmax(logits) if logp is None else logp, out=logp)     # (T, V) softmax
    d[xp.arange(len(targets))[keep], targets[keep]] -= 1.0
    d[~keep] = 0.0
    d *= 1.0 / n
    return d.astype(logits.dtype, copy=False)
