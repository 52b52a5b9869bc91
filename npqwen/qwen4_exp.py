"""The Qwen4-Exp forward pass (Qwen3.8-Flash-Next): a packed batch of tokens -> logits. Read it top to bottom.

Qwen4-Exp is Qwen3.5-MoE (Gated DeltaNet on three layers of four, 512 experts with a sigmoid-gated shared expert,
partial RoPE, output-gated attention; npqwen/model.py runs those parts and this class reuses them) with three
new parts, each in its own file:
- hyper-connections (npqwen/hyper_connections.py): the residual is C = hc_count streams of D side by side; before
  each block a learned gate mixes them into the block's input, and the block's output is added back to every
  stream with its own weight. There is no input, post-attention or final RMSNorm: the mixing normalises.
- QSA (npqwen/qsa.py): each full-attention layer's indexer picks, per query, the best blocks of r earlier tokens
  under a token budget, and attention reads only those (and the last tokens that fill no block).
- Per-Layer Embeddings (npqwen/ple.py): some linear layers first add hashed n-gram embeddings, looked up in
  tables left on disk (memory-mapped), gated per stream and convolved over time.

Shapes: T tokens, D hidden, C streams, S positions of one sequence; the rest as in npqwen/model.py.

forward: x = embed, copied into C streams -> for each layer: [x += ple(x)]; a, w = mix(x); x += w * attention(a);
m, w = mix(x); x += w * moe(m) -> mix(x) -> lm_head.

Steering and SAE feature edits act on a layer's output, the C streams (T, C*D) that hooks call model.layers.L: a
(D,) steering vector goes to every stream (npqwen/steering.py), an SAE there reads all C*D values. Speculative
verification ("ngram" drafts) keeps each PLE layer's convolution state after every token, and the n-gram history,
to roll back to (kv_cache.LinearStates.roll_back); QSA keeps nothing per sequence beyond its pages.
LoRA adapters (npqwen/lora.py) add to their rows after every projection, as in Qwen3's layers: attention's, the
indexer's, the Gated DeltaNet's, the shared expert's, the hyper-connections' and PLE's. Under tensor parallelism
(npqwen/parallel.py) the ranks meet where Qwen3.5-MoE's do (the embedding, o_proj / out_proj, the experts' sum and the
shared expert's down_proj, the logits); the C streams, the mixing, PLE and the indexer are whole on every rank.
Not here: the MTP head (transformers ignores its mtp.* weights: no forward to check one against); it is refused by
name.
"""
import numpy as np

from . import hyper_connections as hc
from . import lora, ops, ple, qsa
from .errors import NpqwenError
from .features import apply_feature_edits
from .model import BatchOutput, Qwen3, as_hook, no_recorder
from .parallel import share_batch


class Qwen4Exp(Qwen3):
    """Config + weights (HF names) + the Qwen4-Exp forward pass; Qwen3's Gated DeltaNet, MoE and caches reused."""

    def forward_batch(self, batch, kv, recorder=no_recorder, embeds=None) -> BatchOutput:
        """One packed forward pass, as Qwen3.forward_batch: each sequence's keys, values, indexer keys and states are
        written; the logits of the rows that sample (and hidden states, scores) come back."""
        cfg, W, xp, C = self.config, self.weights, self.xp, self.config.hc_count
        recorder = as_hook(recorder)
        if embeds is not None:
            raise NpqwenError("Qwen4-Exp: inputs_embeds (an MTP head's input) are not fed to it: npqwen runs no MTP "
                              "head for Qwen4-Exp (transformers ignores its mtp.* weights, so there is no forward "
                              "to check one against)")
        # 0. tensor parallel: every rank runs rank 0's batch (rank 0 sends it to the others)
        batch = share_batch(self, batch, kv, recorder is not no_recorder)
        # 1. embedding lookup (a token's row is on one rank, the others add zeros), then C copies of it side by side:
        # the C residual streams start equal
        x = ops.embed(W["model.embed_tokens.weight"], xp.asarray(batch.token_ids), self.vocab_start)   # (T, D)
        x = self.comm.all_reduce(x)
        x = recorder("model.embed_tokens", x)
        x = xp.tile(x, (1, C))                                                                   # (T, C*D)
        # 2. RoPE tables for each token's own position (text: mRoPE's three positions are equal, plain RoPE)
        cos, sin = ops.rope_cos_sin(self.inv_freq, xp.asarray(batch.positions), self.rope_scale, self.dtype)  # (T, rot)
        cos, sin = recorder("model.rotary_emb.cos", cos), recorder("model.rotary_emb.sin", sin)
        slots = xp.asarray(kv.slots(batch.write_pages, batch.write_offsets))    # where new keys/values go
        kv.states.reset(batch.new_slots)   # a sequence at position 0 starts its states from zero (PLE: from eos)
        previous = [kv.states.ple_ids[s].copy() for s in batch.slots] if cfg.ple_layer_ids else None   # (n-1,) each
        # LoRA: each adapter in the batch and its rows (each sequence's adapter, or none; npqwen/lora.py)
        loras = lora.row_groups(batch.loras, batch.rows, len(batch.token_ids), xp)   # [(adapter, rows)]
        # 3. the decoder layers
        for i in range(cfg.num_hidden_layers):
            x = self.decoder_layer(i, x, cos, sin, batch, kv, slots, recorder, loras, previous=previous)
            if i in batch.feature_edits:   # SAE feature edits on the C streams: (a' - a) * W_dec[f] (F, C*D)
                x = apply_feature_edits(x, batch.feature_edits[i])
            if i in batch.steering:   # steering: s*v on the steered rows' C streams (T, C*D), zeros elsewhere
                x = x + batch.steering[i]
        if cfg.ple_layer_ids:   # each sequence's last n-1 tokens, for its next batch's n-grams
            for (row, n), slot, prev, verify in zip(batch.rows, batch.slots, previous, batch.verifying):
                history = np.concatenate([prev, batch.token_ids[row:row + n]])   # (ngram_size - 1 + n,)
                kv.states.ple_ids[slot] = history[-len(prev):]
                if verify and n > 1:   # speculative: a roll-back to `kept` tokens keeps history[kept:kept + n-1]
                    kv.states.ple_verified.setdefault(slot, {})["ids"] = history
        # 4. the C streams mixed into one, for the rows that have an output (the final norm's place)
        rows = batch.output_rows
        if len(rows) < x.shape[0] or (rows != np.arange(len(rows))).any():
            x = x[xp.asarray(rows)]                                                  # (B, C*D)
        p, out_loras = "model.hyper_connection_mixer", lora.output_groups(batch.loras, batch.rows, rows, xp)
        x, _ = hc.mix_streams(x, W[f"{p}.hc_norm.weight"], W[f"{p}.input_mix_weight_down.weight"],
                              W[f"{p}.input_mix_weight_up.weight"], C, cfg.rms_norm_eps, out_loras, p)   # (B, D)
        x = recorder(p, x)
        return self.outputs(x, batch, recorder)   # 5. lm_head, hidden states and scores, as Qwen3's

    def decoder_layer(self, i: int, x, cos, sin, batch, kv, slots, recorder=no_recorder, loras=(), previous=None):
        """[x += PLE]; then two hyper-connected blocks: a, w = mix(x); x += w * block(a). (T, C*D) -> (T, C*D)."""
        cfg, W, p, C, eps = self.config, self.weights, f"model.layers.{i}", self.config.hc_count, self.config.rms_norm_eps
        if cfg.is_ple_layer(i):   # Per-Layer Embeddings: hashed n-grams, gated per stream, convolved, added
            x = x + recorder(f"{p}.ple", self.ple(i, x, batch, kv, previous))                 # (T, C*D)
        h = f"{p}.attn_hyper_connection"   # (`loras`: each LoRA adapter adds to its rows after each projection)
        a, x, w = hc.gated_residual(x, W[f"{h}.hc_norm.weight"], W[f"{h}.input_mix_weight_down.weight"],
                                    W[f"{h}.input_mix_weight_up.weight"], W[f"{h}.block_inject_weight.weight"],
                                    C, eps, loras, h)                             # (T, D), (T, C*D), (T, C)
        a = recorder(h, a)
        attn = self.linear_attn if cfg.is_linear_layer(i) else self.self_attn      # Gated DeltaNet or QSA
        x = hc.inject(x, attn(i, a, cos, sin, batch, kv, slots, recorder, loras), w)   # (T, C*D)
        x = recorder(f"{p}.attn_residual", x)
        h = f"{p}.mlp_hyper_connection"
        m, x, w = hc.gated_residual(x, W[f"{h}.hc_norm.weight"], W[f"{h}.input_mix_weight_down.weight"],
                                    W[f"{h}.input_mix_weight_up.weight"], W[f"{h}.block_inject_weight.weight"],
                                    C, eps, loras, h)
        m = recorder(h, m)
        x = hc.inject(x, self.sparse_moe(i, m, recorder, loras), w)                # (T, C*D)
        return recorder(p, x)

    def ple(self, i: int, x, batch, kv, previous):
        """Layer i's Per-Layer Embeddings for every sequence of the batch, each from its own last n-1 tokens and
        convolution state. (T, C*D) -> (T, C*D)."""
        cfg, W, p, xp = self.config, self.weights, f"model.layers.{i}.ple", self.xp
        j = cfg.ple_index(i)
        multipliers, sizes, offsets = ple.hash_constants(cfg, j)                            # (n,), (Hn,), (Hn,)
        table = W[f"{p}.ple_embedding.ngram_embedding.weight"]                              # (rows, d), on disk
        conv = kv.states.ple_conv[j]                                                        # (slots, L, C*D)
        out, adapters = xp.empty_like(x), batch.loras or [None] * len(batch.rows)   # each sequence's LoRA adapter
        for (row, n), slot, prev, verify, adapter in zip(batch.rows, batch.slots, previous, batch.verifying, adapters):
            r = slice(row, row + n)
            emb = ple.ngram_embedding(table, batch.token_ids[r], prev, multipliers, sizes, offsets,
                                      cfg.heads_per_ngram, kv.states.eos)                  # (n, E) float32
            emb = xp.asarray(emb, dtype=x.dtype)
            loras = [(adapter, slice(None))] if adapter is not None else []              # all n rows, or none
            if verify and n > 1:   # speculative verification: token by token as decoding runs, each state kept
                states = []
                for t in range(row, row + n):
                    e = emb[t - row:t - row + 1]                                           # (1, E)
                    out[t:t + 1], conv[slot] = ple.ple_layer(x[t:t + 1], e, W, p, cfg.hc_count, conv[slot],
                                                             cfg.ngram_size, cfg.rms_norm_eps,
                                                             self.ple_projections(p, e, loras))
                    states.append(conv[slot].copy())                                       # (L, C*D)
                kv.states.ple_verified.setdefault(slot, {})[j] = xp.stack(states)          # (n, L, C*D)
                continue
            out[r], conv[slot] = ple.ple_layer(x[r], emb, W, p, cfg.hc_count, conv[slot], cfg.ngram_size,
                                               cfg.rms_norm_eps, self.ple_projections(p, emb, loras))   # (n, C*D)
        return out

    def ple_projections(self, p: str, emb, loras):
        """PLE's key_proj and value_proj of the n-gram embeddings, each with its LoRA update on its rows:
        (n, E) -> (n, C*D), (n, D)."""
        W = self.weights
        key = lora.add(ops.linear(emb, W[f"{p}.key_proj.weight"]), emb, loras, f"{p}.key_proj")           # (n, C*D)
        value = lora.add(ops.linear(emb, W[f"{p}.value_proj.weight"]), emb, loras, f"{p}.value_proj")     # (n, D)
        return key, value

    def self_attn(self, i: int, x, cos, sin, batch, kv, slots, recorder=no_recorder, loras=()):
        """QSA: output-gated, QK-normed, partly rotary grouped-query attention of layer i, each query reading only
        the tokens its indexer selected. (T, D) -> (T, D)."""
        cfg, W, p, xp = self.config, self.weights, f"model.layers.{i}.self_attn", self.xp
        T, H, K, Dh = x.shape[0], self.heads, self.kv_heads, cfg.head_dim
        Hi, di, c = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.cache_index(i)
        # the indexer's queries (T, Hi, di), normalised and rotated, and raw keys (T, di); the keys go to the pages with
        # the rest (under tensor parallelism every rank holds the whole indexer and makes the same selection)
        iq, ik = qsa.indexer_queries_keys(x, W[f"{p}.indexer.index_qk_proj.weight"],
                                          W[f"{p}.indexer.q_layernorm.weight"], Hi, di, cos, sin,
                                          cfg.rms_norm_eps, loras, f"{p}.indexer.index_qk_proj")
        kv.write_index_keys(c, batch.write_pages, batch.write_offsets, ik)
        # q (with each head's output gate), k, v: as Qwen3.5's attention
        qkv = ops.linear(x, self.fused[f"{p}.qkv_proj.weight"])                     # (T, 2H*Dh + 2K*Dh)
        qkv = lora.add(qkv, x, loras, f"{p}.qkv_proj")                  # + scale * B A x, each adapter's rows
        Q = 2 * H * Dh
        q, k, v = qkv[:, :Q], qkv[:, Q:Q + K * Dh], qkv[:, Q + K * Dh:]
        q, k, v = recorder(f"{p}.q_proj", q), recorder(f"{p}.k_proj", k), recorder(f"{p}.v_proj", v)
        q, gate = q.reshape(T, H, 2 * Dh)[..., :Dh], q.reshape(T, H, 2 * Dh)[..., Dh:].reshape(T, H * Dh)
        q = ops.rms_norm(q, W[f"{p}.q_norm.weight"], cfg.rms_norm_eps, 1.0)        # (T, H, Dh), 1 + weight
        k = ops.rms_norm(k.reshape(T, K, Dh), W[f"{p}.k_norm.weight"], cfg.rms_norm_eps, 1.0)   # (T, K, Dh)
        q, k = recorder(f"{p}.q_norm", q), recorder(f"{p}.k_norm", k)
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        q, k = recorder(f"{p}.q_rope", q), recorder(f"{p}.k_rope", k)
        kv.write(c, slots, k, v.reshape(T, K, Dh))
        # each sequence: its indexer's selection, then attention over the selected positions only
        out, probs = xp.empty((T, H * Dh), dtype=x.dtype), None
        for (row, n), start, table in zip(batch.rows, batch.starts, batch.page_tables):
            r, S = slice(row, row + n), start + n
            keys = qsa.gather_pages(kv.index_keys[c], table, S)                        # (S, di) raw
            cos_all, sin_all = ops.rope_cos_sin(self.inv_freq, xp.arange(S), self.rope_scale, self.dtype)  # (S, rot)
            visible = np.arange(S)[None, :] <= np.arange(start, S)[:, None]          # (n, S) causal
            chosen = qsa.select_tokens(iq[r], keys, visible, W[f"{p}.indexer.k_layernorm.weight"], cos_all,
                                       sin_all, cfg.indexer_budget, cfg.indexer_compress_ratio, cfg.rms_norm_eps)
            allowed = recorder(f"{p}.indexer", qsa.selection_mask(chosen, S))          # (n, S) bool
            out[r], probs = qsa.sparse_attention(q[r], qsa.gather_pages(kv.keys[c], table, S),
                                                 qsa.gather_pages(kv.values[c], table, S), allowed)
        if recorder is not no_recorder:   # kept for a recorder: every rank's heads
            probs = self.comm.all_gather(probs, axis=0)                         # (H, n, S)
        recorder(f"{p}.attn_probs", probs)   # the last sequence's (H, n, S): seen, not replaced
        out = recorder(f"{p}.attn_output", out)                                  # (T, H*Dh)
        out = out * ops.sigmoid(gate)                                            # the output gate
        o = ops.linear(out, W[f"{p}.o_proj.weight"])                             # (T, H*Dh) -> (T, D)
        o = lora.add(o, out, loras, f"{p}.o_proj")                               # + scale * B A x, each adapter's rows
        o = self.comm.all_reduce(o)                                              # the sum of every rank's heads
        return recorder(f"{p}.o_proj", o)                                        # (T, D)
