"""The operators of Qwen3, as small pure functions over arrays (NumPy or CuPy).

Shapes: T tokens in this call, S positions attended (cached + new), D hidden size,
H query heads, K key/value heads, G = H / K, Dh head dim, F MLP width, V vocab size.

Every function keeps its input's dtype (float32 on CPU). Scalars are Python floats: NumPy 2
turns `float32_array * np.float64(...)` into float64, which silently makes matmuls ~200x slower.
"""
import math

import numpy as np

from .backend import xp_of


def embed(weight, token_ids):
    """Row lookup: one D-vector per token."""
    return weight[token_ids]                          # (V, D)[(T,)] -> (T, D)


def rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in (at least) float32 as HF does."""
    xp = xp_of(x)
    xf = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
    inv_rms = 1.0 / xp.sqrt((xf * xf).mean(axis=-1, keepdims=True) + eps)   # (..., 1)
    return weight * (xf * inv_rms).astype(x.dtype, copy=False)               # (..., D)


def silu(x):
    """x * sigmoid(x); the tanh form never overflows: sigmoid(x) = (1 + tanh(x/2)) / 2."""
    xp = xp_of(x)
    return x * (0.5 + 0.5 * xp.tanh(0.5 * x))


def swiglu(gate, up):
    """Qwen3's MLP nonlinearity: silu(gate) * up."""
    return silu(gate) * up                            # (T, F), (T, F) -> (T, F)


def softmax(x):
    """exp(x - max) / sum(...) over the last axis, in (at least) float32; subtracting the max keeps exp finite."""
    xp = xp_of(x)
    xf = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
    e = xp.exp(xf - xf.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype, copy=False)


def rope_frequencies(config) -> tuple[np.ndarray, float]:
    """Inverse frequencies theta^(-2i/Dh), i < Dh/2, and the cos/sin scale, as transformers computes them.

    "linear" divides every frequency by `factor`; "yarn" interpolates the low frequencies
    (long wavelengths) and keeps the high ones, then scales cos/sin by 0.1 ln(factor) + 1.
    Computed in float32 on the host, like HF's torch code.
    """
    dim, base = config.head_dim, config.rope_theta
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
    """Rotate each pair (x[j], x[j + Dh/2]) by its position's angle: the half-split convention.

    Not llama's interleaved pairs (x[2j], x[2j+1]): HF Qwen3 rotates split halves.
    """
    xp = xp_of(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]                 # (T, n_heads, Dh/2) each
    c, s = cos[:, None, :half], sin[:, None, :half]       # (T, 1, Dh/2), broadcast over heads
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)   # (T, n_heads, Dh)


def causal_mask(T: int, S: int, start: int, dtype, xp):
    """Additive mask: token t (at position start + t) sees positions 0 .. start + t; -inf elsewhere."""
    future = xp.arange(S)[None, :] > (start + xp.arange(T))[:, None]        # (T, S) bool
    return xp.where(future, -np.inf, 0.0).astype(dtype)                     # (T, S)


def attention(q, k, v, start: int):
    """Causal grouped-query attention without copying K/V per query head.

    q: (T, H, Dh) queries at positions start .. start + T - 1; k, v: (K, S, Dh) for positions
    0 .. S - 1 with S = start + T. Query head h reads key/value head h // G (HF's repeat_kv
    order 0,0,1,1,...), so grouping the H query heads as (K, G) lets one batched matmul per
    K-head serve its G query heads. Returns the output (T, H*Dh) and the probabilities (H, T, S).
    """
    xp = xp_of(q)
    T, H, Dh = q.shape
    K, S, _ = k.shape
    G = H // K
    qg = q.transpose(1, 0, 2).reshape(K, G * T, Dh)                 # (K, G*T, Dh): rows (g, t)
    scores = (qg @ k.transpose(0, 2, 1)) * (1.0 / math.sqrt(Dh))    # (K, G*T, S)
    scores = scores.reshape(K, G, T, S)
    if T > 1:
        scores = scores + causal_mask(T, S, start, scores.dtype, xp)   # (T, S) broadcast over (K, G)
    probs = softmax(scores)                                         # (K, G, T, S)
    out = probs.reshape(K, G * T, S) @ v                            # (K, G*T, Dh)
    out = out.reshape(H, T, Dh).transpose(1, 0, 2).reshape(T, H * Dh)
    return out, probs.reshape(H, T, S)
