"""The Qwen3 forward pass: token ids -> logits. Read it top to bottom.

Shapes: T tokens in this call, S positions attended (cached + new), D hidden size,
H query heads, K key/value heads, G = H / K, Dh head dim, F MLP width, V vocab size.
Qwen3-0.6B: D=1024, H=16, K=8, G=2, Dh=128, F=3072, V=151936, 28 layers.

forward: embed -> for each layer: x += attention(norm(x)); x += mlp(norm(x)) -> norm -> lm_head.
Attention normalises q and k per head (QK-norm) *before* RoPE, rotates split halves, and
lets G query heads share one key/value head (GQA).

`recorder`, when given, is called as recorder(name, array) with every intermediate result
under its HF module name (see `npqwen trace`); when it is None nothing extra runs.
"""
import numpy as np

from . import ops
from .backend import to_numpy, xp_of
from .config import Qwen3Config
from .errors import NpqwenError


class KVCache:
    """Keys and values of every layer for positions 0 .. length-1, preallocated for `capacity` positions.

    Both are stored transposed, (Dh, positions): a decode step then reads each head's keys and
    values as Dh contiguous rows of positions, which BLAS streams fastest (scores = q @ keys,
    output = values @ probs^T).
    """

    def __init__(self, config: Qwen3Config, capacity: int, xp, dtype):
        if capacity > config.max_position_embeddings:
            raise NpqwenError(f"a KV cache of {capacity} positions exceeds the model's context of "
                              f"{config.max_position_embeddings} (max_position_embeddings)")
        L, K, Dh = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.keys = xp.zeros((L, K, Dh, capacity), dtype=dtype)     # (layers, K, Dh, capacity)
        self.values = xp.zeros((L, K, Dh, capacity), dtype=dtype)   # (layers, K, Dh, capacity)
        self.capacity = capacity
        self.length = 0                                # positions filled so far

    def write(self, layer: int, start: int, k, v, tile: int = 16):
        """Store k, v (T, K, Dh) at positions start .. start + T - 1 of `layer`, transposing them.

        A tile of positions at a time: the transposed copy then stays in the CPU cache.
        """
        for t in range(0, k.shape[0], tile):
            part_k, part_v = k[t:t + tile], v[t:t + tile]                          # (n, K, Dh)
            s, n = start + t, part_k.shape[0]
            self.keys[layer][:, :, s:s + n] = part_k.transpose(1, 2, 0)             # (K, Dh, n)
            self.values[layer][:, :, s:s + n] = part_v.transpose(1, 2, 0)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class Qwen3:
    """Config + weights (HF names) + the forward pass. Built by `npqwen.load`."""

    def __init__(self, config: Qwen3Config, weights: dict, fused: dict):
        self.config = config
        self.weights = weights    # HF name -> array with the HF shape
        self.fused = fused        # per-layer stacked qkv_proj / gate_up_proj; HF q/k/v/gate/up are views
        embed = weights["model.embed_tokens.weight"]
        self.xp, self.dtype = xp_of(embed), embed.dtype
        inv_freq, self.rope_scale = ops.rope_frequencies(config)
        self.inv_freq = self.xp.asarray(inv_freq)      # (Dh/2,) float32

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.config, capacity, self.xp, self.dtype)

    def forward(self, token_ids, cache: KVCache | None = None, last_only: bool = False, recorder=None):
        """Logits (T, V) for `token_ids` (or (1, V) for the last token when last_only).

        With a cache, the tokens continue at position cache.length, their keys/values are
        appended, and attention reads every cached position.
        """
        cfg, W, xp = self.config, self.weights, self.xp
        ids = self._check_ids(token_ids, cache)
        start = cache.length if cache is not None else 0
        T = len(ids)

        # 1. embedding lookup
        x = ops.embed(W["model.embed_tokens.weight"], xp.asarray(ids))       # (T, D)
        if recorder is not None: recorder("model.embed_tokens", x)
        # 2. RoPE tables for positions start .. start+T-1, shared by every layer
        positions = xp.arange(start, start + T)
        cos, sin = ops.rope_cos_sin(self.inv_freq, positions, self.rope_scale, self.dtype)   # (T, Dh) each
        if recorder is not None: recorder("model.rotary_emb.cos", cos); recorder("model.rotary_emb.sin", sin)
        # 3. the decoder layers, each two residual updates
        for i in range(cfg.num_hidden_layers):
            x = self.decoder_layer(i, x, cos, sin, cache, start, recorder)
        if cache is not None:
            cache.length = start + T
        # 4. final norm, only where logits are wanted
        if last_only:
            x = x[-1:]                                                           # (1, D)
        x = ops.rms_norm(x, W["model.norm.weight"], cfg.rms_norm_eps)          # (T, D)
        if recorder is not None: recorder("model.norm", x)
        # 5. lm_head (tied to the embedding in small Qwen3s)
        logits = x @ W["lm_head.weight"].T                                     # (T, D) @ (D, V) -> (T, V)
        if recorder is not None: recorder("lm_head", logits)
        return logits

    def decoder_layer(self, i: int, x, cos, sin, cache, start: int, recorder=None):
        """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h))."""
        p, W, eps = f"model.layers.{i}", self.weights, self.config.rms_norm_eps
        a = ops.rms_norm(x, W[f"{p}.input_layernorm.weight"], eps)
        if recorder is not None: recorder(f"{p}.input_layernorm", a)
        h = x + self.self_attn(i, a, cos, sin, cache, start, recorder)         # (T, D)
        if recorder is not None: recorder(f"{p}.attn_residual", h)
        m = ops.rms_norm(h, W[f"{p}.post_attention_layernorm.weight"], eps)
        if recorder is not None: recorder(f"{p}.post_attention_layernorm", m)
        out = h + self.mlp(i, m, recorder)                                     # (T, D)
        if recorder is not None: recorder(p, out)
        return out

    def self_attn(self, i: int, x, cos, sin, cache, start: int, recorder=None):
        """QK-normed, rotary, grouped-query causal attention of layer i."""
        cfg, W, p = self.config, self.weights, f"model.layers.{i}.self_attn"
        T, H, K, Dh = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q_proj, k_proj, v_proj in one matmul: qkv_proj stacks their rows
        qkv = x @ self.fused[f"{p}.qkv_proj.weight"].T                         # (T, (H + 2K) * Dh)
        q, k, v = qkv[:, :H * Dh], qkv[:, H * Dh:(H + K) * Dh], qkv[:, (H + K) * Dh:]
        if recorder is not None: recorder(f"{p}.q_proj", q); recorder(f"{p}.k_proj", k); recorder(f"{p}.v_proj", v)
        # QK-norm: RMSNorm over each head's Dh values, before RoPE
        q = ops.rms_norm(q.reshape(T, H, Dh), W[f"{p}.q_norm.weight"], cfg.rms_norm_eps)   # (T, H, Dh)
        k = ops.rms_norm(k.reshape(T, K, Dh), W[f"{p}.k_norm.weight"], cfg.rms_norm_eps)   # (T, K, Dh)
        if recorder is not None: recorder(f"{p}.q_norm", q); recorder(f"{p}.k_norm", k)
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        if recorder is not None: recorder(f"{p}.q_rope", q); recorder(f"{p}.k_rope", k)
        v = v.reshape(T, K, Dh)
        if cache is not None:   # append this call's keys/values, then attend to every cached position
            cache.write(i, start, k, v)
            keys, values = cache.keys[i][:, :, :start + T], cache.values[i][:, :, :start + T]  # (K, Dh, S) each
        else:
            keys, values = k.transpose(1, 2, 0), v.transpose(1, 2, 0)          # (K, Dh, T) each
        out, probs = ops.attention(q, keys, values, start, want_probs=recorder is not None)   # (T, H*Dh), (H, T, S)
        if recorder is not None: recorder(f"{p}.attn_probs", probs); recorder(f"{p}.attn_output", out)
        out = out @ W[f"{p}.o_proj.weight"].T                                   # (T, H*Dh) -> (T, D)
        if recorder is not None: recorder(f"{p}.o_proj", out)
        return out

    def mlp(self, i: int, x, recorder=None):
        """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""
        p, F = f"model.layers.{i}.mlp", self.config.intermediate_size
        gate_up = x @ self.fused[f"{p}.gate_up_proj.weight"].T                  # (T, 2F): gate_proj | up_proj
        gate, up = gate_up[:, :F], gate_up[:, F:]                               # (T, F) each
        if recorder is not None: recorder(f"{p}.gate_proj", gate); recorder(f"{p}.up_proj", up)
        act = ops.silu(gate)                                                    # (T, F)
        if recorder is not None: recorder(f"{p}.act_fn", act)
        out = (act * up) @ self.weights[f"{p}.down_proj.weight"].T              # (T, F) -> (T, D)
        if recorder is not None: recorder(f"{p}.down_proj", out)
        return out

    def _check_ids(self, token_ids, cache) -> np.ndarray:
        """Token ids as a 1-D int64 host array, checked against the vocabulary and the context."""
        try:
            ids = np.asarray(to_numpy(token_ids) if not isinstance(token_ids, list) else token_ids)
        except (TypeError, ValueError) as e:
            raise NpqwenError(f"token_ids must be a 1-D sequence of integers: {e}") from e
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise NpqwenError(f"token_ids must be a non-empty 1-D sequence of integers, got shape "
                              f"{ids.shape} dtype {ids.dtype}")
        V = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= V:
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise NpqwenError(f"token id {bad} is outside the vocabulary 0 .. {V - 1}")
        start = cache.length if cache is not None else 0
        limit = cache.capacity if cache is not None else self.config.max_position_embeddings
        if start + ids.size > limit:
            what = "KV cache" if cache is not None else "context (max_position_embeddings)"
            raise NpqwenError(f"{start + ids.size} positions do not fit the {what} of {limit}; "
                              f"use a shorter input")
        return ids.astype(np.int64)
