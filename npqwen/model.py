"""The Qwen3 forward pass: a packed batch of tokens -> logits. Read it top to bottom.

Shapes: T tokens in this call (every sequence's new tokens, back to back), S positions one
sequence attends (cached + new), D hidden size, H query heads, K key/value heads, G = H / K,
Dh head dim, F MLP width, V vocab size, N pages in the KV cache, P positions per page.
Qwen3-0.6B: D=1024, H=16, K=8, G=2, Dh=128, F=3072, V=151936, 28 layers.
Qwen3-MoE adds E experts, k per token, of width I: Qwen3-30B-A3B has D=2048, H=32, K=4, E=128,
k=8, I=768, 48 layers.
Qwen3.5 and Qwen3-Next (hybrid) make most layers Gated DeltaNet linear attention (`linear_attn`,
npqwen/linear_attention.py: Hk key heads of dk, Hv value heads of dv, a state of (Hv, dk, dv) per sequence)
and the rest full attention with an output gate and RoPE on part of each head; their RMSNorms scale by
1 + weight. Qwen3.5-0.8B: D=1024, H=8, K=2, Dh=256 (64 rotated), Hk=Hv=16, dk=dv=128, 18 of 24 layers linear.
Under tensor parallelism over N ranks (npqwen/parallel.py) H, K, F, V, Hk and Hv are this rank's share:
H/N query heads, their key/value heads, F/N of the MLP's width, V/N of the vocabulary, Hk/N key and Hv/N
value heads of the linear layers (and their states); D is whole.

forward: embed -> for each layer: x += attention(norm(x)); x += mlp(norm(x)) -> norm -> lm_head.
Attention normalises q and k per head (QK-norm) *before* RoPE, rotates split halves, and
lets G query heads share one key/value head (GQA). Qwen2 / Qwen2.5 is the same pass with biases on
q, k and v and no QK-norm (config.attention_bias, config.qk_norm: one line each in self_attn).
In Qwen3-MoE the MLP of most layers is sparse (`sparse_moe`, npqwen/moe.py): a router picks k experts per token.

The model knows nothing of requests. A `Batch` says which tokens run, at which positions, and
which pages of the `KVCache` hold each sequence's keys and values (both in npqwen/kv_cache.py);
every matrix product runs once over all T tokens, and only attention looks at one sequence at a
time. `forward_batch` returns what the batch asked for (`BatchOutput`: logits, hidden states,
scores) and writes nothing but keys and values. `Qwen3.forward` (a list of token ids, optionally
continuing a `SequenceCache`) is the same pass for a batch of one sequence.

The ranks meet in five places, each one line that does nothing in one process (`self.comm` is
then comm.SingleProcess): rank 0 shares the batch; the embedding's and each layer's o_proj (out_proj in a
linear-attention layer) and down_proj (the experts' sum in a sparse layer) outputs are all-reduced (each
rank holds a part of the sum); the logits are all-gathered.
(A recorder that asks for attention probabilities gets every rank's heads, gathered: a sixth.)

`recorder`, when given, is called as recorder(name, array) with every intermediate result
under its HF module name (see `npqwen trace`); by default it is `no_recorder`, which returns the
array unchanged. A recorder that returns an array (a hook, npqwen/hooks.py) replaces the value
from then on: each step reads `x = recorder(name, x)`. A recorder changes values, never which
code runs: the same functions run with or without one (with one, attention also keeps a copy of
its probabilities, which a hook can read but not replace: they were used already).
`batch.steering` adds a request's steering vectors to its rows after a block (npqwen/steering.py);
`batch.feature_edits` sets an SAE feature's activation on a request's rows after a block (npqwen/features.py).
"""
from typing import NamedTuple

import numpy as np

from . import linear_attention as la
from . import lora, moe, ops
from .backend import xp_of
from .checks import check_token_ids
from .comm import SingleProcess
from .config import Qwen3Config
from .errors import NpqwenError
from .features import apply_feature_edits
from .kv_cache import Batch, KVCache, SequenceCache
from .parallel import share_batch, split_range


def no_recorder(name, array):
    """The default recorder: keeps nothing, changes nothing (the value goes on as it is)."""
    return array


def as_hook(recorder):
    """A recorder as the forward pass calls it: what it returns replaces the value from then on
    (npqwen/hooks.py checks it), None leaves the value as it is (a recorder that only keeps)."""
    if recorder is None or recorder is no_recorder:
        return no_recorder

    def hook(name, array):
        new = recorder(name, array)
        return array if new is None else new
    return hook


def check_lm_head(model):
    """Logits need an lm_head; a checkpoint saved from Qwen3Model (Qwen3-Embedding-8B) has none."""
    if not getattr(model, "has_lm_head", True):   # (a test's stand-in model has logits of its own)
        raise NpqwenError("this checkpoint has no lm_head (it was saved from Qwen3Model, as Qwen3-Embedding "
                          "models are): it computes embeddings (llm.embed) but no logits, so it cannot generate "
                          "or rerank")


def linear_heads(config, weights: dict) -> tuple[int, int] | None:
    """(Hk, Hv) of the weights' Gated DeltaNet layers: a rank's share under tensor parallelism (A_log has one
    value per value head, and every rank keeps the same Hv/Hk value heads per key head); None for a Qwen3."""
    first = next((i for i in range(config.num_hidden_layers) if config.is_linear_layer(i)), None)
    if first is None:
        return None
    Hv = weights[f"model.layers.{first}.linear_attn.A_log"].shape[0]
    return Hv * config.linear_num_key_heads // config.linear_num_value_heads, Hv


class BatchOutput(NamedTuple):
    """What forward_batch returns for a Batch: the rows each kind of request asked for."""
    logits: object         # (len(sample_rows), V) for the rows that sample
    hidden: object         # (R, D) final-norm hidden states of hidden_rows (embeddings)
    scores: object = None  # (Q, k) the logits of score_ids at score_rows (rerank); None when no row scores


class Qwen3:
    """Config + weights (HF names) + the forward pass. Built by `npqwen.load`."""

    def __init__(self, config: Qwen3Config, weights: dict, fused: dict, comm=None):
        self.config = config
        self.weights = weights    # HF name -> array with the HF shape (a rank's part of it under tensor parallelism)
        self.fused = fused        # per-layer stacked qkv_proj / gate_up_proj; HF q/k/v/gate/up (and experts) are views
        self.comm = comm or SingleProcess()   # the ranks the model is split over (npqwen/comm.py)
        norm = weights.get("model.norm.weight", weights.get("model.hyper_connection_mixer.hc_norm.weight"))   # an
        # array always (matrices may be compact: npqwen/weights.py); Qwen4-Exp has the final mixing's instead
        self.xp, self.dtype = xp_of(norm), norm.dtype
        Dh = config.head_dim      # this rank's heads (all of them in one process), and its first token id
        first = next((i for i in range(config.num_hidden_layers) if not config.is_linear_layer(i)), None)
        attn = f"model.layers.{first}.self_attn" if first is not None else None   # (a hybrid one may have none)
        gate = 2 if config.hybrid else 1                # Qwen3.5's q_proj also yields the output gate
        self.heads = weights[f"{attn}.q_proj.weight"].shape[0] // Dh // gate if attn else config.num_attention_heads
        self.kv_heads = weights[f"{attn}.k_proj.weight"].shape[0] // Dh if attn else config.num_key_value_heads
        self.linear_heads = linear_heads(config, weights)   # (Hk, Hv) of this rank's Gated DeltaNet layers
        self.vocab_start = split_range(config.vocab_size, self.comm.size, self.comm.rank).start
        inv_freq, self.rope_scale = ops.rope_frequencies(config)
        self.inv_freq = self.xp.asarray(inv_freq)      # (Dh/2,) float32

    def new_cache(self, capacity: int) -> SequenceCache:
        return SequenceCache(self.config, capacity, self.xp, self.dtype, kv_heads=self.kv_heads,
                             linear_heads=self.linear_heads)

    def new_kv_cache(self, num_pages: int, page_size: int, num_slots: int = 1, kv_dtype: str = "auto") -> KVCache:
        return KVCache(self.config, num_pages, page_size, self.xp, self.dtype, self.kv_heads, num_slots,
                       self.linear_heads, kv_dtype)

    def forward(self, token_ids, cache: SequenceCache | None = None, last_only: bool = False, recorder=None,
                lora=None):
        """Logits (T, V) for one sequence's `token_ids` (or (1, V) for the last token when last_only).

        With a cache, the tokens continue at position cache.length, their keys/values are
        appended, and attention reads every cached position. `lora`: a LoraAdapter (npqwen/lora.py)
        added to every linear layer it adapts. A batch of one through forward_batch.
        """
        ids = self._check_ids(token_ids, cache)
        T = len(ids)
        if cache is None:   # attention still reads keys from pages: one page that holds just these tokens
            cache = SequenceCache(self.config, T, self.xp, self.dtype, page_size=T, kv_heads=self.kv_heads,
                                  linear_heads=self.linear_heads)
        start = cache.length
        batch = Batch(ids, [start], [T], [cache.page_table], cache.kv.page_size,
                      sample_rows=np.array([T - 1]) if last_only else np.arange(T), loras=[lora])
        out = self.forward_batch(batch, cache.kv, recorder)
        cache.length = start + T
        return out.logits

    def forward_batch(self, batch: Batch, kv: KVCache, recorder=no_recorder, embeds=None) -> BatchOutput:
        """One packed forward pass: each sequence's new keys/values go to its pages; the logits of the
        rows that sample, and the hidden states and scores prefill-only requests asked for, come back.
        `embeds` (T, D), when given, enter the first layer instead of the tokens' embeddings (HF's
        inputs_embeds; the MTP head, npqwen/mtp.py)."""
        cfg, W, xp = self.config, self.weights, self.xp
        recorder = as_hook(recorder)   # returns the value, or a hook's replacement of it
        # 0. tensor parallel: every rank runs rank 0's batch (rank 0 sends it to the others)
        batch = share_batch(self, batch, kv, recorder is not no_recorder)
        # 1. embedding lookup: a token's row is on one rank, the others add zeros
        if embeds is None:
            x = ops.embed(W["model.embed_tokens.weight"], xp.asarray(batch.token_ids), self.vocab_start)   # (T, D)
            x = self.comm.all_reduce(x)
        else:
            x = embeds                                                                     # (T, D)
        x = recorder("model.embed_tokens", x)
        # 2. RoPE tables for each token's own position, shared by every layer
        cos, sin = ops.rope_cos_sin(self.inv_freq, xp.asarray(batch.positions), self.rope_scale, self.dtype)  # (T, Dh)
        cos, sin = recorder("model.rotary_emb.cos", cos), recorder("model.rotary_emb.sin", sin)
        slots = xp.asarray(kv.slots(batch.write_pages, batch.write_offsets))          # where new keys/values go
        # LoRA: each adapter in the batch and its rows (each sequence's adapter, or none; npqwen/lora.py)
        loras = lora.row_groups(batch.loras, batch.rows, len(batch.token_ids), xp)   # [(adapter, rows)]
        if kv.states is not None:   # hybrid: a sequence at position 0 starts its linear layers' states from zero
            kv.states.reset(batch.new_slots)
        # 3. the decoder layers, each two residual updates
        for i in range(cfg.num_hidden_layers):
            x = self.decoder_layer(i, x, cos, sin, batch, kv, slots, recorder, loras)
            if i in batch.feature_edits:   # SAE feature edits: (a' - a) * W_dec[f] on the edited requests' rows
                x = apply_feature_edits(x, batch.feature_edits[i])
            if i in batch.steering:   # steering: s*v added to the steered requests' rows, zeros elsewhere (T, D)
                x = x + batch.steering[i]
        # 4. final norm, only for the rows that have an output (usually: the rows that sample)
        rows = batch.output_rows
        if len(rows) < x.shape[0] or (rows != np.arange(len(rows))).any():
            x = x[xp.asarray(rows)]                                                  # (B, D)
        x = ops.rms_norm(x, W["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
        x = recorder("model.norm", x)
        return self.outputs(x, batch, recorder)

    def outputs(self, x, batch, recorder=no_recorder) -> BatchOutput:
        """The final hidden states of the output rows, (B, D) (sample rows, then hidden rows, then score rows) ->
        what the batch asked for."""
        xp = self.xp
        # 5. lm_head (tied to the embedding in small Qwen3s), for the rows that sample; under tensor
        # parallelism every rank's V/N logits side by side
        S, R = len(batch.sample_rows), len(batch.hidden_rows)
        if S:
            logits = self.comm.all_gather(ops.linear(x[:S], self.lm_head_weight()))   # (S, D) @ (D, V) -> (S, V)
        else:
            logits = xp.zeros((0, self.config.vocab_size), x.dtype)
        logits = recorder("lm_head", logits)
        # 6. prefill-only outputs: hidden states as they are (embeddings), and a few tokens' logits (rerank):
        # k rows of lm_head, looked up as the embedding is (under tensor parallelism the rank holding a row adds it)
        hidden, scores = x[S:S + R], None                                          # (R, D)
        if len(batch.score_rows):
            ids = xp.asarray(batch.score_ids)                                      # (Q, k)
            heads = ops.embed(self.lm_head_weight(), ids.reshape(-1), self.vocab_start).reshape(*ids.shape, -1)
            scores = self.comm.all_reduce(xp.einsum("qd,qkd->qk", x[S + R:], heads))   # (Q, k)
        return BatchOutput(logits, hidden, scores)

    @property
    def has_lm_head(self) -> bool:
        return "lm_head.weight" in self.weights

    def lm_head_weight(self):
        """lm_head.weight (V, D), or a clear error for a checkpoint saved without one (Qwen3Model)."""
        check_lm_head(self)
        return self.weights["lm_head.weight"]

    def decoder_layer(self, i: int, x, cos, sin, batch, kv, slots, recorder=no_recorder, loras=()):
        """Pre-norm residual block: x + attention(norm(x)), then h + mlp(norm(h))."""
        p, W, eps, one = f"model.layers.{i}", self.weights, self.config.rms_norm_eps, self.config.norm_offset
        a = ops.rms_norm(x, W[f"{p}.input_layernorm.weight"], eps, one)
        a = recorder(f"{p}.input_layernorm", a)
        attn = self.linear_attn if self.config.is_linear_layer(i) else self.self_attn   # Qwen3.5: Gated DeltaNet
        h = x + attn(i, a, cos, sin, batch, kv, slots, recorder, loras)              # (T, D)
        h = recorder(f"{p}.attn_residual", h)
        m = ops.rms_norm(h, W[f"{p}.post_attention_layernorm.weight"], eps, one)
        m = recorder(f"{p}.post_attention_layernorm", m)
        mlp = self.sparse_moe if self.config.is_moe_layer(i) else self.mlp        # Qwen3-MoE: routed to experts
        out = h + mlp(i, m, recorder, loras)                                         # (T, D)
        return recorder(p, out)

    def self_attn(self, i: int, x, cos, sin, batch, kv, slots, recorder=no_recorder, loras=()):
        """QK-normed, rotary, grouped-query causal attention of layer i, each sequence over its own pages."""
        cfg, W, p = self.config, self.weights, f"model.layers.{i}.self_attn"
        T, H, K, Dh, Q = x.shape[0], self.heads, self.kv_heads, cfg.head_dim, self.q_width
        # q_proj, k_proj, v_proj in one matmul: qkv_proj stacks their rows
        qkv = ops.linear(x, self.fused[f"{p}.qkv_proj.weight"])                # (T, Q + 2K*Dh)
        if cfg.attention_bias:   # Qwen2: q, k and v add their biases, stacked as their rows are
            qkv = qkv + self.fused[f"{p}.qkv_proj.bias"]                       # (T, Q + 2K*Dh) + (Q + 2K*Dh,)
        qkv = lora.add(qkv, x, loras, f"{p}.qkv_proj")                         # + scale * B A x, each adapter's rows
        q, k, v = qkv[:, :Q], qkv[:, Q:Q + K * Dh], qkv[:, Q + K * Dh:]
        q, k, v = recorder(f"{p}.q_proj", q), recorder(f"{p}.k_proj", k), recorder(f"{p}.v_proj", v)
        if cfg.hybrid:   # Qwen3.5: each head's Dh query values are followed by Dh values of its output gate
            q, gate = q.reshape(T, H, 2 * Dh)[..., :Dh], q.reshape(T, H, 2 * Dh)[..., Dh:].reshape(T, H * Dh)
        q, k = q.reshape(T, H, Dh), k.reshape(T, K, Dh)                         # (T, H, Dh), (T, K, Dh)
        if cfg.qk_norm:   # QK-norm: RMSNorm over each head's Dh values, before RoPE (Qwen3; Qwen2 has none)
            q = ops.rms_norm(q, W[f"{p}.q_norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)   # (T, H, Dh)
            k = ops.rms_norm(k, W[f"{p}.k_norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)   # (T, K, Dh)
            q, k = recorder(f"{p}.q_norm", q), recorder(f"{p}.k_norm", k)
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        q, k = recorder(f"{p}.q_rope", q), recorder(f"{p}.k_rope", k)
        # every token's key and value go to its page first, so a sequence's attention reads them from there
        c = cfg.cache_index(i)     # this layer's row of the KV cache (i in Qwen3: every layer has one)
        kv.write(c, slots, k, v.reshape(T, K, Dh))
        out, probs = self.attention(q, kv.keys[c], kv.values[c], batch, want_probs=recorder is not no_recorder)
        if probs is not None:   # kept for a recorder: every rank's heads
            probs = self.comm.all_gather(probs, axis=0)                                   # (H, n, S)
        recorder(f"{p}.attn_probs", probs)   # the last sequence's (H, n, S): seen, not replaced (used already)
        out = recorder(f"{p}.attn_output", out)                                 # (T, H*Dh): the heads side by side
        if cfg.hybrid:   # Qwen3.5's output gate: each head's output scaled by sigmoid(gate)
            out = out * ops.sigmoid(gate)                                       # (T, H*Dh)
        o = ops.linear(out, W[f"{p}.o_proj.weight"])                            # (T, H*Dh) -> (T, D)
        o = lora.add(o, out, loras, f"{p}.o_proj")                              # + scale * B A x, each adapter's rows
        o = self.comm.all_reduce(o)                                             # the sum of every rank's heads
        return recorder(f"{p}.o_proj", o)

    @property
    def q_width(self) -> int:
        """Rows of q_proj on this rank: H*Dh, twice that when it also yields Qwen3.5's output gate."""
        return self.heads * self.config.head_dim * (2 if self.config.hybrid else 1)

    def linear_attn(self, i: int, x, cos, sin, batch: Batch, kv: KVCache, slots, recorder=no_recorder, loras=()):
        """Gated DeltaNet (npqwen/linear_attention.py) of layer i: each sequence continues from its states in
        kv.states; a prompt's tokens run the chunked form, decoding sequences one batched recurrent step.
        Takes the arguments self_attn takes; each adapter adds to its rows after each projection, as in self_attn."""
        cfg, W, p, xp = self.config, self.weights, f"model.layers.{i}.linear_attn", self.xp
        (Hk, Hv), T = self.linear_heads, x.shape[0]   # this rank's heads (all of them in one process)
        heads = (Hk, cfg.linear_key_head_dim, Hv, cfg.linear_value_head_dim)
        Hv, dv = heads[2:]
        conv, state = kv.states.conv[cfg.cache_index(i)], kv.states.recurrent[cfg.cache_index(i)]   # (S, ...)
        # the four input projections: q, k, v (convolved together), the output gate z, beta and the decay
        # (each `lora.add` is + scale * B A x on each adapter's rows, as after self_attn's projections)
        if cfg.qwen3_next:   # the same four, from two matrices whose rows are grouped by key head
            qkvz = lora.add(ops.linear(x, W[f"{p}.in_proj_qkvz.weight"]), x, loras, f"{p}.in_proj_qkvz")  # (T, C+Hv*dv)
            ba = lora.add(ops.linear(x, W[f"{p}.in_proj_ba.weight"]), x, loras, f"{p}.in_proj_ba")        # (T, 2Hv)
            qkvz, ba = recorder(f"{p}.in_proj_qkvz", qkvz), recorder(f"{p}.in_proj_ba", ba)
            mixed, z, b, a = la.ungroup_qwen3_next(qkvz, ba, *heads)
        else:
            mixed = lora.add(ops.linear(x, W[f"{p}.in_proj_qkv.weight"]), x, loras, f"{p}.in_proj_qkv")  # (T, C)
            z = lora.add(ops.linear(x, W[f"{p}.in_proj_z.weight"]), x, loras, f"{p}.in_proj_z")          # (T, Hv*dv)
            b = lora.add(ops.linear(x, W[f"{p}.in_proj_b.weight"]), x, loras, f"{p}.in_proj_b")          # (T, Hv)
            a = lora.add(ops.linear(x, W[f"{p}.in_proj_a.weight"]), x, loras, f"{p}.in_proj_a")          # (T, Hv)
            mixed, z = recorder(f"{p}.in_proj_qkv", mixed), recorder(f"{p}.in_proj_z", z)
            b, a = recorder(f"{p}.in_proj_b", b), recorder(f"{p}.in_proj_a", a)
        z = z.reshape(T, Hv, dv)
        g, beta = la.decay_and_beta(a, b, W[f"{p}.A_log"], W[f"{p}.dt_bias"])   # (T, Hv) each, float32
        kernel = W[f"{p}.conv1d.weight"][:, 0]                                  # (C, W)
        out = xp.empty((T, Hv, dv), dtype=state.dtype)                          # float32 (float64 for float64)
        for (row, n), slot, verify in zip(batch.rows, batch.slots, batch.verifying):
            if n > 1 and verify:   # speculative verification: token by token, each token's states kept to roll back to
                r = slice(row, row + n)
                inputs = xp.concatenate([conv[slot].astype(mixed.dtype), mixed[r]])     # (W-1+n, C) the conv's inputs
                mixed_r, conv_r = la.causal_conv1d(mixed[None, r], kernel, conv[slot][None])   # (1, n, C), (1, W-1, C)
                q, k, v = la.queries_keys_values(mixed_r[0], *heads)                # (n, Hv, dk), (n, Hv, dv)
                out[r], states = la.delta_rule_states(q, k, v, g[r], beta[r], state[slot])   # (n, Hv, dk, dv)
                conv[slot], state[slot] = conv_r[0], states[-1]
                kv.states.verified.setdefault(slot, {})[cfg.cache_index(i)] = (inputs, states)
            elif n > 1:   # a prompt's chunk: the convolution, then the chunked delta rule, from this sequence's states
                r = slice(row, row + n)
                mixed_r, conv_r = la.causal_conv1d(mixed[None, r], kernel, conv[slot][None])   # (1, n, C), (1, W-1, C)
                conv[slot] = conv_r[0]
                q, k, v = la.queries_keys_values(mixed_r[0], *heads)                # (n, Hv, dk), (n, Hv, dv)
                out[r], state[slot] = la.chunked_gated_delta_rule(q, k, v, g[r], beta[r], state[slot])
        if len(batch.decode_rows):   # one new token per sequence: one batched step for all of them
            rows, s = xp.asarray(batch.decode_rows), batch.decode_slots
            mixed_d, conv[s] = la.causal_conv1d(mixed[rows][:, None], kernel, conv[s])   # (B, 1, C)
            q, k, v = la.queries_keys_values(mixed_d[:, 0], *heads)              # (B, Hv, dk), (B, Hv, dv)
            out[rows], state[s] = la.delta_rule_step(q, k, v, g[rows], beta[rows], state[s])
        out = recorder(f"{p}.core_attn_out", out)
        gate = ops.sigmoid if cfg.output_gate_type == "sigmoid" else ops.silu   # (Qwen4-Exp may say sigmoid)
        out = la.gated_rms_norm(out.astype(x.dtype), z, W[f"{p}.norm.weight"], cfg.rms_norm_eps, gate)   # (T, Hv, dv)
        out = recorder(f"{p}.norm", out)
        h = out.reshape(T, Hv * dv)                                             # (T, Hv*dv): the heads side by side
        out = ops.linear(h, W[f"{p}.out_proj.weight"])                          # (T, Hv*dv) -> (T, D)
        out = lora.add(out, h, loras, f"{p}.out_proj")                          # + scale * B A x, each adapter's rows
        out = self.comm.all_reduce(out)                                         # the sum of every rank's heads
        return recorder(f"{p}.out_proj", out)

    def attention(self, q, keys, values, batch: Batch, want_probs: bool = False):
        """Causal attention of each sequence over its own pages: (T, H*Dh), and with want_probs the
        probabilities of the batch's last sequence (H, n, S). The same calls run either way: want_probs
        only keeps a copy of the probabilities the softmax computes anyway."""
        out = self.xp.empty((q.shape[0], q.shape[1] * q.shape[2]), dtype=q.dtype)   # (T, H*Dh)
        probs = None
        for (row, n), start, table in zip(batch.rows, batch.starts, batch.page_tables):
            if n > 1:   # sequences with several new tokens (a prompt's chunk): one at a time
                out[row:row + n], probs = ops.paged_attention(q[row:row + n], keys, values, table, start,
                                                              want_probs=want_probs)
        if len(batch.decode_rows):   # sequences with one new token (decoding): one batched softmax for all of them
            rows = self.xp.asarray(batch.decode_rows)
            out[rows], decode_probs = ops.paged_decode_attention(q[rows], keys, values, batch.decode_tables,
                                                                 batch.decode_lengths, want_probs)   # (B, H, S)
            if want_probs and batch.lengths[-1] == 1:   # the batch's last sequence decodes: its row of them
                probs = decode_probs[-1, :, None, :batch.decode_lengths[-1]]       # (H, 1, S)
        return out, probs

    def mlp(self, i: int, x, recorder=no_recorder, loras=(), name: str = "mlp"):
        """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)). `name`: "mlp.shared_expert" for Qwen3.5-MoE's."""
        p = f"model.layers.{i}.{name}"
        gate_up = ops.linear(x, self.fused[f"{p}.gate_up_proj.weight"])         # (T, 2F): gate_proj | up_proj
        gate_up = lora.add(gate_up, x, loras, f"{p}.gate_up_proj")              # + scale * B A x, each adapter's rows
        F = gate_up.shape[1] // 2
        gate, up = gate_up[:, :F], gate_up[:, F:]                               # (T, F) each
        gate, up = recorder(f"{p}.gate_proj", gate), recorder(f"{p}.up_proj", up)
        act = ops.silu(gate)                                                    # (T, F)
        act = recorder(f"{p}.act_fn", act)
        h = act * up                                                            # (T, F)
        out = ops.linear(h, self.weights[f"{p}.down_proj.weight"])              # (T, F) -> (T, D)
        out = lora.add(out, h, loras, f"{p}.down_proj")                         # + scale * B A x, each adapter's rows
        out = self.comm.all_reduce(out)                                         # the sum of every rank's width
        return recorder(f"{p}.down_proj", out)

    def sparse_moe(self, i: int, x, recorder=no_recorder, loras=()):
        """Qwen3-MoE's MLP: the router sends each token to k experts; their SwiGLUs, weighted, are summed."""
        cfg, p = self.config, f"model.layers.{i}.mlp"
        logits, chosen, weights = moe.route(x, self.weights[f"{p}.gate.weight"], cfg.num_experts_per_tok,
                                            cfg.norm_topk_prob)                 # (T, E), (T, k), (T, k)
        recorder(f"{p}.gate", logits)   # seen, not replaced: the experts were chosen from them already
        chosen, weights = recorder(f"{p}.gate.top_k_index", chosen), recorder(f"{p}.gate.top_k_weights", weights)
        out = moe.experts(x, chosen, weights, self.fused[f"{p}.experts.gate_up_proj"],
                          self.fused[f"{p}.experts.down_proj"])                  # (T, D)
        out = self.comm.all_reduce(out)                                         # the sum of every rank's width
        out = recorder(f"{p}.experts", out)
        if cfg.shared_expert_intermediate_size:   # Qwen3.5-MoE: a shared expert every token runs, sigmoid-gated
            gate = ops.linear(x, self.weights[f"{p}.shared_expert_gate.weight"])   # (T, 1), before its sigmoid
            gate = lora.add(gate, x, loras, f"{p}.shared_expert_gate")            # + scale * B A x, each adapter's rows
            gate = recorder(f"{p}.shared_expert_gate", gate)
            out = out + ops.sigmoid(gate) * self.mlp(i, x, recorder, loras, name="mlp.shared_expert")
        return out

    def _check_ids(self, token_ids, cache) -> np.ndarray:
        """Token ids as a 1-D int64 host array, checked against the vocabulary and the context."""
        ids = check_token_ids(token_ids, self.config.vocab_size)   # the same rule as LLM.prompt_ids
        if ids.size == 0:
            raise NpqwenError("token_ids is empty: forward needs at least one token")
        start = cache.length if cache is not None else 0
        limit = cache.capacity if cache is not None else self.config.max_position_embeddings
        if start + ids.size > limit:
            what = "KV cache" if cache is not None else "context (max_position_embeddings)"
            raise NpqwenError(f"{start + ids.size} positions do not fit the {what} of {limit}; "
                              f"use a shorter input")
        return ids.astype(np.int64)
