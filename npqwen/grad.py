"""Gradients: the backward pass of the Qwen3 forward (model.py), written as plainly, in reverse.

    g = grad.gradients(llm, "The capital of France is", grad.log_prob(target))   # target: a token id
    g.value                                   # log p(target) after the prompt
    g["model.layers.3.mlp.act_fn"]            # (T, F): d value / d that activation
    g["model.layers.3.mlp.down_proj.weight"]  # (D, F): d value / d that weight

The forward runs once with a `Tape`, a recorder (model.py) that keeps a copy of every step's array
under its HF name; a recorder never changes which code runs, so the tape holds exactly what inference
computes. `backward` then walks the steps in reverse, each operator's backward (ops.py, moe.py and
linear_attention.py, each beside its forward) turning the gradient of a step's output into the
gradients of its inputs and weights. The gradient of the scalar with respect to an activation is kept
under the same name run_with_cache uses (npqwen/hooks.py step_names), and with respect to a weight under
its HF name (a tied lm_head: both names hold the sum of both uses; Qwen3-MoE's experts also under
transformers' fused names `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`).

What is differentiated, from the value back: an objective (a token's log-probability, the loss over
next tokens, a logit difference: each a function of the logits that returns the value and d value /
d logits), lm_head, the final norm, each layer (MLP or sparse MLP, then attention or Gated DeltaNet,
each behind its RMSNorm and its residual), the embedding. Qwen4-Exp: its C residual streams, each block
behind its hyper-connection (the mixing and the injection weights, npqwen/hyper_connections.py), QSA's
attention over the selected positions (npqwen/qsa.py), the PLE layers (npqwen/ple.py), and the final mixing in
the final norm's place. Not differentiated: the experts' choice, QSA's selection and the positions (steps, not
functions; the indexer's weights get zeros, as transformers leaves their .grad None); cos/sin of RoPE; the PLE
n-gram tables (frozen on disk: the looked-up rows' gradient is kept as `model.layers.i.ple.ple_embedding`). One sequence from position 0, one process (no
tensor parallelism). With a LoRA adapter (lora=...), its A and B too (npqwen/finetune.py trains one).
The logits are not kept on the tape (the forward returns them); with checkpoint=True only the residual
stream is, and each layer runs again just before its backward.

Shapes as in model.py: T tokens, D hidden, H query heads, K kv heads, G = H/K, Dh head dim, F MLP width,
V vocab.
"""
import difflib
from typing import NamedTuple

import numpy as np

from . import hyper_connections as hc
from . import linear_attention as la
from . import lora, moe, ops, ple, qsa
from .backend import xp_of
from .errors import NpqwenError


class NotFinite(NpqwenError):
    """The value is nan or inf (a diverged training step): no gradient is taken."""


class Tape(dict):
    """A recorder that keeps a copy of every array a forward pass records, on its device: tape[name]. With
    keep (a function of the name), only those: activation checkpointing keeps the residual stream alone."""

    def __init__(self, keep=None):
        super().__init__()
        self.keep = keep

    def __call__(self, name: str, array):
        if array is not None and name != "lm_head" and (self.keep is None or self.keep(name)):
            self[name] = array.copy()   # (not the logits: the forward returns them, and the backward starts after)


def residual_stream(name: str) -> bool:
    """What activation checkpointing keeps: each layer's input and output, RoPE's tables, the final norm."""
    return not name.startswith("model.layers.") or name.count(".") == 2


class Objective(NamedTuple):
    """A scalar of the logits: fn(logits (T, V)) -> (value, d value / d logits (T, V)); its name for messages."""
    fn: object
    name: str


def log_prob(token: int, position: int = -1) -> Objective:
    """log p(token) at `position` (the next-token distribution after it)."""
    def fn(logits):
        logp = ops.log_softmax(logits[position])                                   # (V,)
        d = -xp_of(logits).exp(logp)                                               # d log p_t / d z = 1[t] - p
        d[token] += 1.0
        return float(logp[token]), place(logits, position, d)
    return Objective(fn, f"log p({token}) at {position}")


def logit_diff(token: int, other: int, position: int = -1) -> Objective:
    """logit[token] - logit[other] at `position`."""
    def fn(logits):
        d = xp_of(logits).zeros(logits.shape[1], dtype=logits.dtype)             # (V,)
        d[token], d[other] = 1.0, -1.0
        return float(logits[position, token] - logits[position, other]), place(logits, position, d)
    return Objective(fn, f"logit {token} - logit {other} at {position}")


def loss(targets=None) -> Objective:
    """The mean cross-entropy of `targets` (T,) (on the host or the model's device), -100 where a row is not
    counted; by default each row's next token (the last row uncounted): the language-model loss HF computes from
    labels = the input ids."""
    def fn(logits, ids=None):
        t = type_like(logits, next_tokens(ids) if targets is None else targets)   # (T,)
        logp, rows = ops.log_softmax(logits), xp_of(logits).flatnonzero(t != -100)   # (T, V) once, for both
        value = -float(logp[rows, t[rows]].mean())                        # the counted rows' -log p(target)
        return value, ops.cross_entropy_backward(logits, t, logp=logp)   # logp used up
    fn.wants_ids = targets is None
    return Objective(fn, "loss")


def next_tokens(ids) -> np.ndarray:
    """Row t's target is token t + 1; the last row has none (-100)."""
    return np.append(np.asarray(ids)[1:], -100).astype(np.int64)


def place(logits, position: int, d_row):
    """A (T, V) gradient that is d_row (V,) at `position` and zero elsewhere, in the logits' dtype, on their device."""
    d = xp_of(logits).zeros_like(logits)                                           # (T, V)
    d[position] = d_row
    return d


def type_like(array, a):
    """`a` (a NumPy array or a list, or already on `array`'s device: no copy) on `array`'s device."""
    return xp_of(array).asarray(a)


class Gradients(dict):
    """d value / d every activation (step_names' names) and every weight (HF names) of one pass: grads[name].
    .value: the objective's value; .logits (T, V); .tape: the activations themselves, by the same names."""

    def __init__(self, value: float, logits, tape: Tape, lora=None, weights: bool = True, activations: bool = True):
        super().__init__()
        self.value, self.logits, self.tape = value, logits, tape
        self.weight_names: list[str] = []
        self.want_weights = weights            # the base weights' gradients (skipped for attribution, LoRA training)
        self.want_activations = activations    # the activations' gradients (kept for all but LoRA training)
        self.lora = lora              # a LoraAdapter the forward added (npqwen/lora.py), or None
        self.lora_grads: dict = {}    # its lora_A / lora_B gradients, by the adapter's names

    def add(self, name: str, d):
        """An activation's gradient, kept when activations are wanted."""
        if self.want_activations:
            self[name] = d

    def add_weight(self, name: str, d):
        """Accumulate: a weight used twice (a tied embedding's) gets the sum of both gradients."""
        self[name] = d if name not in self else self[name] + d
        if name not in self.weight_names:
            self.weight_names.append(name)

    def weights(self) -> dict:
        return {name: self[name] for name in self.weight_names}

    def __missing__(self, name):
        near = difflib.get_close_matches(str(name), list(self), n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        weight = str(name).endswith((".weight", ".A_log", ".dt_bias", "experts.gate_up_proj", "experts.down_proj"))
        weights = " (weights=False: no weight's gradient was taken)" if weight and not self.weight_names else ""
        raise NpqwenError(f"no gradient named {name!r}{weights}{hint}")

    def activations(self) -> dict:
        return {name: d for name, d in self.items() if name not in self.weight_names}


def model_of(llm_or_model):
    """The Qwen3 of an LLM (npqwen.load's result), or the Qwen3 itself."""
    return getattr(llm_or_model, "model", llm_or_model)


def gradients(llm, prompt, objective: Objective, hooks=None, weights: bool = True, lora=None,
              activations: bool = True, checkpoint: bool = False) -> Gradients:
    """One forward pass over `prompt` (text or token ids) that keeps every activation, then one backward pass
    from `objective`'s value: Gradients (a dict by name) with .value and .logits. `hooks` as run_with_hooks
    (the gradient is then the patched model's); weights=False skips the weights' gradients (attribution);
    `lora`, a LoraAdapter: the forward adds it and .lora_grads holds its gradients (npqwen/finetune.py);
    activations=False keeps no activation's gradient; checkpoint=True keeps only the residual stream going
    forward and recomputes each layer's steps just before its backward (one more forward's work, a layer's
    activations in memory instead of every layer's)."""
    from .hooks import Hooks, both

    model = model_of(llm)
    ids = np.asarray(llm.prompt_ids(prompt) if hasattr(llm, "prompt_ids") else prompt, dtype=np.int64)
    tape = Tape(residual_stream if checkpoint else None)
    hooked = None if hooks is None else Hooks(hooks, model.config)
    recorder = tape if hooked is None else both(tape, hooked)
    logits = model.forward(ids, recorder=recorder, lora=lora)                      # (T, V)
    if getattr(objective.fn, "wants_ids", False):
        value, d_logits = objective.fn(logits, ids)
    else:
        value, d_logits = objective.fn(logits)
    if not np.isfinite(value):
        raise NotFinite(f"{objective.name} is {value}: there is no gradient to take")
    grads = Gradients(value, logits, tape, lora, weights, activations)
    return backward(model, tape, ids, d_logits, grads, (lambda i: recompute_layer(model, i, ids, tape, lora, hooked))
                    if checkpoint else None)


def backward(model, tape: Tape, ids, d_logits, grads: Gradients, recompute=None) -> Gradients:
    """The forward pass in reverse: lm_head, the final norm, each layer from the last, the embedding.
    `recompute(i)`, with activation checkpointing: layer i's steps put back on the tape before its backward."""
    cfg, W = model.config, model.weights
    if model.comm.size > 1:
        raise NpqwenError("gradients run in one process; load the model without tensor_parallel")
    L, eps, one, weights = cfg.num_hidden_layers, cfg.rms_norm_eps, cfg.norm_offset, grads.want_weights
    keep = grads.add_weight if weights else (lambda name, d: None)
    final = "model.hyper_connection_mixer" if cfg.qwen4_exp else "model.norm"   # Qwen4-Exp: the streams mixed into one
    # 5. lm_head: logits = norm(x) @ lm_head^T
    grads.add("lm_head", d_logits)
    d_norm, d_head = linear_backward(grads, "lm_head", d_logits, tape[final], model.lm_head_weight())
    keep("lm_head.weight", d_head)                                                 # (T, D), (V, D)
    # 4. the final norm (Qwen4-Exp: the final mixing of the C streams, (T, D) -> (T, C*D))
    grads.add(final, d_norm)
    if cfg.qwen4_exp:
        p = "model.hyper_connection_mixer"
        d_x, *d_ws = hc.mix_streams_backward(d_norm, tape[f"model.layers.{L - 1}"],
                                             *[W[f"{p}.{name}"] for name in HC_WEIGHTS[:3]], cfg.hc_count, eps,
                                             None, adapter_rows(grads), p, projection_backward(grads))
        for name, d_w in zip(HC_WEIGHTS, d_ws):
            keep(f"{p}.{name}", d_w)
    else:
        d_x, d_w = ops.rms_norm_backward(d_norm, tape[f"model.layers.{L - 1}"], W["model.norm.weight"], eps, one)
        keep("model.norm.weight", d_w)
    # 3. the decoder layers, last first
    for i in reversed(range(L)):
        grads.add(f"model.layers.{i}", d_x)
        if recompute is not None:
            recompute(i)
        if cfg.qwen4_exp:
            d_x = qwen4_layer_backward(model, i, tape, ids, d_x, grads, keep)
        else:
            d_x = decoder_layer_backward(model, i, tape, d_x, grads, keep)
        if recompute is not None:   # this layer's steps go again: one layer's activations at a time
            for name in [n for n in tape if n.startswith(f"model.layers.{i}.")]:
                del tape[name]
    # 1. the embedding: each token's row (Qwen4-Exp: copied into the C streams, so the sum of the streams' gradients)
    if cfg.qwen4_exp:
        d_x = d_x.reshape(d_x.shape[0], cfg.hc_count, -1).sum(axis=1)                 # (T, C*D) -> (T, D)
    grads.add("model.embed_tokens", d_x)
    if weights:
        d_embed = ops.embed_backward(d_x, xp_of(d_x).asarray(ids), cfg.vocab_size)      # (V, D)
        if cfg.tie_word_embeddings:   # one array used twice: both names hold the sum of both uses
            d_embed += grads.pop("lm_head.weight")
            grads.weight_names.remove("lm_head.weight")
            keep("lm_head.weight", d_embed)
        keep("model.embed_tokens.weight", d_embed)
    return grads


def adapter_rows(grads: Gradients) -> list:
    """The adapter being trained and its rows (all of them: one sequence), as a forward's `loras` groups."""
    return [] if grads.lora is None else [(grads.lora, slice(None))]


def projection_backward(grads: Gradients):
    """linear_backward as the Qwen4-Exp parts' backwards take it: (d_y, x, weight, name) -> (d_x, d_weight)."""
    return lambda d_y, x, weight, name: linear_backward(grads, name, d_y, x, weight)


def linear_backward(grads: Gradients, matrix: str, d_y, x, weight):
    """ops.linear_backward of one projection (its weight's gradient only when wanted, else None), plus the
    path of the adapter being trained, if any (lora.add_backward): d_x (T, in), d_weight (out, in)."""
    d_x, d_w = ops.linear_backward(d_y, x, weight, grads.want_weights)            # (T, in), (out, in) or None
    if grads.lora is not None:
        d_lora_x, lora_grads = lora.add_backward(d_y, x, grads.lora, matrix)
        d_x = d_x + d_lora_x
        grads.lora_grads.update(lora_grads)
    return d_x, d_w


def recompute_layer(model, i: int, ids, tape: Tape, adapter=None, hooks=None):
    """Activation checkpointing: decoder layer i run again from its input on the tape, its steps recorded there,
    through the model's own decoder_layer over a batch of this one sequence (as Qwen3.forward builds it)."""
    from .hooks import both
    from .kv_cache import Batch, SequenceCache
    from .model import as_hook

    T, xp = len(ids), model.xp
    cache = SequenceCache(model.config, T, xp, model.dtype, page_size=T, kv_heads=model.kv_heads,
                          linear_heads=model.linear_heads)
    batch = Batch(ids, [0], [T], [cache.page_table], cache.kv.page_size, sample_rows=np.arange(T), loras=[adapter])
    kv = cache.kv
    slots = xp.asarray(kv.slots(batch.write_pages, batch.write_offsets))
    if kv.states is not None:
        kv.states.reset(batch.new_slots)
    keep = Tape(lambda name: name.startswith(f"model.layers.{i}."))
    recorder = as_hook(keep if hooks is None else both(keep, hooks))
    x = layer_input(model.config, tape, i)
    qwen4 = {"previous": [kv.states.ple_ids[s].copy() for s in batch.slots]} if model.config.qwen4_exp else {}
    model.decoder_layer(i, x, tape["model.rotary_emb.cos"], tape["model.rotary_emb.sin"], batch, kv, slots, recorder,
                        lora.row_groups(batch.loras, batch.rows, T, xp), **qwen4)
    tape.update(keep)


def layer_input(cfg, tape: Tape, i: int):
    """Layer i's input: the previous layer's output, or the embedding (Qwen4-Exp: copied into its C streams)."""
    if i:
        return tape[f"model.layers.{i - 1}"]
    x = tape["model.embed_tokens"]                                                 # (T, D)
    return xp_of(x).tile(x, (1, cfg.hc_count)) if cfg.qwen4_exp else x             # (T, C*D) or (T, D)


def block_inputs(cfg, i: int) -> tuple[str, str]:
    """The names of layer i's attention input and MLP input on the tape: the norms' outputs (Qwen4-Exp: the
    hyper-connections' mixed streams, which take the norms' place)."""
    p = f"model.layers.{i}"
    if cfg.qwen4_exp:
        return f"{p}.attn_hyper_connection", f"{p}.mlp_hyper_connection"
    return f"{p}.input_layernorm", f"{p}.post_attention_layernorm"


def decoder_layer_backward(model, i: int, tape: Tape, d_out, grads: Gradients, keep):
    """out = h + mlp(norm(h)), h = x + attn(norm(x)): d_out (T, D) -> d_x (T, D)."""
    p, W, cfg = f"model.layers.{i}", model.weights, model.config
    eps, one = cfg.rms_norm_eps, cfg.norm_offset
    x = layer_input(cfg, tape, i)                                                 # the layer's input (T, D)
    h = tape[f"{p}.attn_residual"]
    # the MLP's residual line: d_out reaches h directly and through the MLP and its norm
    mlp = sparse_moe_backward if cfg.is_moe_layer(i) else mlp_backward
    d_m = mlp(model, i, tape, d_out, grads, keep)                                 # (T, D)
    grads.add(f"{p}.post_attention_layernorm", d_m)
    d_h, d_w = ops.rms_norm_backward(d_m, h, W[f"{p}.post_attention_layernorm.weight"], eps, one)
    keep(f"{p}.post_attention_layernorm.weight", d_w)
    d_h = d_h + d_out
    grads.add(f"{p}.attn_residual", d_h)
    # the attention's residual line
    attn = linear_attn_backward if cfg.is_linear_layer(i) else self_attn_backward
    d_a = attn(model, i, tape, d_h, grads, keep)                                  # (T, D)
    grads.add(f"{p}.input_layernorm", d_a)
    d_x, d_w = ops.rms_norm_backward(d_a, x, W[f"{p}.input_layernorm.weight"], eps, one)
    keep(f"{p}.input_layernorm.weight", d_w)
    return d_x + d_h


def qwen4_layer_backward(model, i: int, tape: Tape, ids, d_out, grads: Gradients, keep):
    """Qwen4-Exp's layer (npqwen/qwen4_exp.py decoder_layer) in reverse: x += ple(x) on a PLE layer; a, w = mix(x),
    h = x + w * attn(a); m, w = mix(h), out = h + w * moe(m). d_out (T, C*D) -> d_x (T, C*D)."""
    cfg, p = model.config, f"model.layers.{i}"
    x = layer_input(cfg, tape, i)                                                 # (T, C*D)
    streams = x + tape[f"{p}.ple"] if cfg.is_ple_layer(i) else x                  # what the attention's mixing reads
    # the MLP's residual line, then the attention's
    d_h = hyper_block_backward(model, i, tape, "mlp", sparse_moe_backward, moe_output(cfg, tape, i),
                               tape[f"{p}.attn_residual"], d_out, grads, keep)    # (T, C*D)
    grads.add(f"{p}.attn_residual", d_h)
    linear = cfg.is_linear_layer(i)
    d_x = hyper_block_backward(model, i, tape, "attn", linear_attn_backward if linear else self_attn_backward,
                               tape[f"{p}.linear_attn.out_proj" if linear else f"{p}.self_attn.o_proj"], streams,
                               d_h, grads, keep)
    if not cfg.is_ple_layer(i):
        return d_x
    # Per-Layer Embeddings: x + ple(x); the n-gram tables frozen (the looked-up rows' gradient kept, not scattered)
    grads.add(f"{p}.ple", d_x)
    emb, W, loras = ple_embedding(model, i, ids), model.weights, adapter_rows(grads)   # (T, E)
    projected = (lora.add(ops.linear(emb, W[f"{p}.ple.key_proj.weight"]), emb, loras, f"{p}.ple.key_proj"),
                 lora.add(ops.linear(emb, W[f"{p}.ple.value_proj.weight"]), emb, loras, f"{p}.ple.value_proj"))
    d_query, d_emb, ple_grads = ple.ple_layer_backward(d_x, x, emb, W, f"{p}.ple", cfg.hc_count, cfg.ngram_size,
                                                       cfg.rms_norm_eps, projected, projection_backward(grads))
    grads.add(f"{p}.ple.ple_embedding", d_emb)
    for name, d_weight in ple_grads.items():
        keep(name, d_weight)
    return d_x + d_query


HC_WEIGHTS = ("hc_norm.weight", "input_mix_weight_down.weight", "input_mix_weight_up.weight",
              "block_inject_weight.weight")   # a gated residual's weights (the final mixer has the first three)


def hyper_block_backward(model, i: int, tape: Tape, block: str, block_backward, out, streams, d_y, grads: Gradients,
                         keep):
    """y = streams + w * block(mix(streams)), w and mix from `{block}_hyper_connection` (recomputed from the streams):
    d_y (T, C*D) -> d_streams (T, C*D), through the identity, the injection weights and the block's input."""
    cfg, W, hp = model.config, model.weights, f"model.layers.{i}.{block}_hyper_connection"
    weights = [W[f"{hp}.{name}"] for name in HC_WEIGHTS]
    loras = adapter_rows(grads)
    _, _, w = hc.gated_residual(streams, *weights, cfg.hc_count, cfg.rms_norm_eps, loras, hp)   # (T, C)
    d_streams, d_out, d_w = hc.inject_backward(d_y, out, w)                       # (T, C*D), (T, D), (T, C)
    d_in = block_backward(model, i, tape, d_out, grads, keep)                     # (T, D) the block's input
    grads.add(hp, d_in)
    d_mixed, *d_ws = hc.gated_residual_backward(d_in, d_w, streams, *weights, cfg.hc_count, cfg.rms_norm_eps,
                                                loras, hp, projection_backward(grads))
    for name, d_weight in zip(HC_WEIGHTS, d_ws):
        keep(f"{hp}.{name}", d_weight)
    return d_streams + d_mixed


def moe_output(cfg, tape: Tape, i: int):
    """The sparse MLP's output as the forward added it up: the experts', + sigmoid(gate) * the shared expert's."""
    p = f"model.layers.{i}.mlp"
    out = tape[f"{p}.experts"]                                                    # (T, D)
    if cfg.shared_expert_intermediate_size:
        out = out + ops.sigmoid(tape[f"{p}.shared_expert_gate"]) * tape[f"{p}.shared_expert.down_proj"]
    return out


def ple_embedding(model, i: int, ids):
    """Layer i's n-gram embeddings (T, E) of `ids` from position 0 (eos before the first), looked up again as
    Qwen4Exp.ple does (T rows of the mapped tables)."""
    cfg, j, eos = model.config, model.config.ple_index(i), model.config.eos_token_ids[0]
    multipliers, sizes, offsets = ple.hash_constants(cfg, j)                                        # (n,), (Hn,), (Hn,)
    table = model.weights[f"model.layers.{i}.ple.ple_embedding.ngram_embedding.weight"]             # (rows, d)
    emb = ple.ngram_embedding(table, ids, np.full(cfg.ngram_size - 1, eos), multipliers, sizes, offsets,
                              cfg.heads_per_ngram, eos)                                             # (T, E) float32
    return model.xp.asarray(emb, dtype=model.dtype)


def mlp_backward(model, i: int, tape: Tape, d_out, grads: Gradients, keep, name: str = "mlp"):
    """out = down_proj(silu(gate_proj(m)) * up_proj(m)): d_out (T, D) -> d_m (T, D)."""
    p, W = f"model.layers.{i}.{name}", model.weights
    m = tape[block_inputs(model.config, i)[1]]                                   # (T, D) the MLP's input
    gate, up, act = tape[f"{p}.gate_proj"], tape[f"{p}.up_proj"], tape[f"{p}.act_fn"]   # (T, F) each
    grads.add(f"{p}.down_proj", d_out)
    d_h, d_w = linear_backward(grads, f"{p}.down_proj", d_out, act * up, W[f"{p}.down_proj.weight"])   # (T, F), (D, F)
    keep(f"{p}.down_proj.weight", d_w)
    grads.add(f"{p}.act_fn", d_h * up)
    d_gate, d_up = ops.swiglu_backward(d_h, gate, up)                            # (T, F) each
    grads.add(f"{p}.gate_proj", d_gate)
    grads.add(f"{p}.up_proj", d_up)
    d_gate_up = xp_of(m).concatenate([d_gate, d_up], axis=1)                       # (T, 2F): gate_proj | up_proj
    d_m, d_w = linear_backward(grads, f"{p}.gate_up_proj", d_gate_up, m, model.fused[f"{p}.gate_up_proj.weight"])
    if d_w is not None:   # (2F, D): gate_proj's rows, then up_proj's
        F = gate.shape[1]
        keep(f"{p}.gate_proj.weight", d_w[:F])
        keep(f"{p}.up_proj.weight", d_w[F:])
    return d_m


def sparse_moe_backward(model, i: int, tape: Tape, d_out, grads: Gradients, keep):
    """out = experts(m, chosen, weights) (+ sigmoid(gate) * shared expert): d_out (T, D) -> d_m (T, D)."""
    p, cfg, W = f"model.layers.{i}.mlp", model.config, model.weights
    m = tape[block_inputs(cfg, i)[1]]                                            # (T, D) the MLP's input
    d_m = xp_of(m).zeros_like(m)
    if cfg.shared_expert_intermediate_size:   # Qwen3.5-MoE: + sigmoid(gate) * shared_expert(m)
        gate, shared = tape[f"{p}.shared_expert_gate"], tape[f"{p}.shared_expert.down_proj"]   # (T, 1), (T, D)
        d_shared = d_out * ops.sigmoid(gate)
        d_gate = ops.sigmoid_backward((d_out * shared).sum(axis=-1, keepdims=True), gate)       # (T, 1)
        grads.add(f"{p}.shared_expert_gate", d_gate)
        d_m_gate, d_w = linear_backward(grads, f"{p}.shared_expert_gate", d_gate, m, W[f"{p}.shared_expert_gate.weight"])
        keep(f"{p}.shared_expert_gate.weight", d_w)
        d_m = d_m + d_m_gate + mlp_backward(model, i, tape, d_shared, grads, keep, name="mlp.shared_expert")
    grads.add(f"{p}.experts", d_out)
    chosen, weights = tape[f"{p}.gate.top_k_index"], tape[f"{p}.gate.top_k_weights"]   # (T, k) each
    gate_up, down = model.fused[f"{p}.experts.gate_up_proj"], model.fused[f"{p}.experts.down_proj"]
    d_x, d_weights, d_gate_up, d_down = moe.experts_backward(d_out, m, chosen, weights, gate_up, down)
    grads.add(f"{p}.gate.top_k_weights", d_weights)
    d_r, d_router, d_logits = moe.route_backward(d_weights, m, W[f"{p}.gate.weight"], tape[f"{p}.gate"], chosen,
                                                 cfg.norm_topk_prob)
    grads.add(f"{p}.gate", d_logits)
    keep(f"{p}.gate.weight", d_router)
    if d_down is None:   # compact experts: a frozen base (QLoRA), no gradients of their own
        return d_m + d_x + d_r
    keep(f"{p}.experts.gate_up_proj", d_gate_up)
    keep(f"{p}.experts.down_proj", d_down)
    I = down.shape[2]
    for e in range(down.shape[0]):   # the checkpoint's per-expert names: views of the fused gradients
        keep(f"{p}.experts.{e}.gate_proj.weight", d_gate_up[e, :I])
        keep(f"{p}.experts.{e}.up_proj.weight", d_gate_up[e, I:])
        keep(f"{p}.experts.{e}.down_proj.weight", d_down[e])
    return d_m + d_x + d_r


def self_attn_backward(model, i: int, tape: Tape, d_o, grads: Gradients, keep):
    """o = o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v)), q, k, v = qkv_proj(a) (Qwen3.5: the output
    scaled by sigmoid of q_proj's gate half): d_o (T, D) -> d_a (T, D)."""
    cfg, W, p = model.config, model.weights, f"model.layers.{i}.self_attn"
    eps, one, Dh, H, K = cfg.rms_norm_eps, cfg.norm_offset, cfg.head_dim, model.heads, model.kv_heads
    a = tape[block_inputs(cfg, i)[0]]                                            # (T, D) the attention's input
    xp, T = xp_of(a), a.shape[0]
    cos, sin = tape["model.rotary_emb.cos"], tape["model.rotary_emb.sin"]
    out = tape[f"{p}.attn_output"]                                                # (T, H*Dh)
    q_proj = tape[f"{p}.q_proj"]
    grads.add(f"{p}.o_proj", d_o)
    if cfg.hybrid:   # out * sigmoid(gate), gate: the second Dh values of each head of q_proj
        gate = q_proj.reshape(T, H, 2 * Dh)[..., Dh:].reshape(T, H * Dh)
        d_gated, d_w = linear_backward(grads, f"{p}.o_proj", d_o, out * ops.sigmoid(gate), W[f"{p}.o_proj.weight"])
        d_gate = ops.sigmoid_backward(d_gated * out, gate)                        # (T, H*Dh)
        d_out = d_gated * ops.sigmoid(gate)
    else:
        d_out, d_w = linear_backward(grads, f"{p}.o_proj", d_o, out, W[f"{p}.o_proj.weight"])   # (T, H*Dh), (D, H*Dh)
    keep(f"{p}.o_proj.weight", d_w)
    grads.add(f"{p}.attn_output", d_out)
    # attention: softmax(q k^T / sqrt(Dh) + mask) v, the probabilities as the forward recorded them
    q, k, v = tape[f"{p}.q_rope"], tape[f"{p}.k_rope"], tape[f"{p}.v_proj"].reshape(T, K, Dh)
    if cfg.qwen4_exp:   # QSA: only the positions the indexer chose; the choice itself has no gradient
        d_q, d_k, d_v = qsa.sparse_attention_backward(d_out, q, k, v, tape[f"{p}.attn_probs"])
        for name in ("index_qk_proj", "q_layernorm", "k_layernorm"):   # zero (transformers: .grad None)
            keep(f"{p}.indexer.{name}.weight", xp.zeros_like(W[f"{p}.indexer.{name}.weight"]))
    else:
        d_q, d_k, d_v = ops.causal_attention_backward(d_out, q, k, v, tape[f"{p}.attn_probs"])
    grads.add(f"{p}.q_rope", d_q)
    grads.add(f"{p}.k_rope", d_k)
    # RoPE, then QK-norm
    d_q, d_k = ops.apply_rope_backward(d_q, cos, sin), ops.apply_rope_backward(d_k, cos, sin)
    grads.add(f"{p}.q_norm", d_q)
    grads.add(f"{p}.k_norm", d_k)
    q_in = q_proj.reshape(T, H, -1)[..., :Dh]                                     # (T, H, Dh) the query half
    d_q, d_wq = ops.rms_norm_backward(d_q, q_in, W[f"{p}.q_norm.weight"], eps, one)
    d_k, d_wk = ops.rms_norm_backward(d_k, tape[f"{p}.k_proj"].reshape(T, K, Dh), W[f"{p}.k_norm.weight"], eps, one)
    keep(f"{p}.q_norm.weight", d_wq)
    keep(f"{p}.k_norm.weight", d_wk)
    if cfg.hybrid:   # q_proj's rows: each head's Dh query values, then its Dh gate values
        d_q = xp.concatenate([d_q, d_gate.reshape(T, H, Dh)], axis=-1)            # (T, H, 2Dh)
    d_q, d_k, d_v = d_q.reshape(T, -1), d_k.reshape(T, K * Dh), d_v.reshape(T, K * Dh)
    grads.add(f"{p}.q_proj", d_q)
    grads.add(f"{p}.k_proj", d_k)
    grads.add(f"{p}.v_proj", d_v)
    # q_proj, k_proj, v_proj: one matrix, qkv_proj, whose rows they are
    d_qkv = xp.concatenate([d_q, d_k, d_v], axis=1)                               # (T, Q + 2K*Dh)
    d_a, d_w = linear_backward(grads, f"{p}.qkv_proj", d_qkv, a, model.fused[f"{p}.qkv_proj.weight"])
    if d_w is not None:   # (Q + 2K*Dh, D): q_proj's rows, k_proj's, v_proj's
        Q = d_q.shape[1]
        keep(f"{p}.q_proj.weight", d_w[:Q])
        keep(f"{p}.k_proj.weight", d_w[Q:Q + K * Dh])
        keep(f"{p}.v_proj.weight", d_w[Q + K * Dh:])
    return d_a


def linear_attn_backward(model, i: int, tape: Tape, d_o, grads: Gradients, keep):
    """Gated DeltaNet (npqwen/linear_attention.py) of one sequence from position 0: out_proj(gated_norm(
    delta_rule(conv(in_proj_qkv(a))), in_proj_z(a))), the decay and write strength from in_proj_a and in_proj_b;
    d_o (T, D) -> d_a (T, D). The convolution, q/k/v and the decay are recomputed from the tape's projections;
    the delta rule's backward is the recurrent form's."""
    cfg, W, p = model.config, model.weights, f"model.layers.{i}.linear_attn"
    a = tape[block_inputs(cfg, i)[0]]                                            # (T, D) the attention's input
    xp, T = xp_of(a), a.shape[0]
    (Hk, Hv), dk, dv = model.linear_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    heads = (Hk, dk, Hv, dv)
    if cfg.qwen3_next:   # two projections whose rows are grouped by key head: Qwen3.5's four, reordered
        mixed, z, b, a_in = la.ungroup_qwen3_next(tape[f"{p}.in_proj_qkvz"], tape[f"{p}.in_proj_ba"], *heads)
    else:
        mixed, z, b, a_in = (tape[f"{p}.{n}"] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    z = z.reshape(T, Hv, dv)                                                             # mixed (T, C); b, a (T, Hv)
    # out_proj, then the gated RMSNorm of each head's output
    grads.add(f"{p}.out_proj", d_o)
    d_h, d_w = linear_backward(grads, f"{p}.out_proj", d_o, tape[f"{p}.norm"].reshape(T, Hv * dv),
                               W[f"{p}.out_proj.weight"])
    keep(f"{p}.out_proj.weight", d_w)
    grads.add(f"{p}.norm", d_h.reshape(T, Hv, dv))
    core = tape[f"{p}.core_attn_out"].astype(a.dtype)                                    # (T, Hv, dv)
    gate = ops.sigmoid if cfg.output_gate_type == "sigmoid" else ops.silu   # as the forward (Qwen4-Exp may say sigmoid)
    d_core, d_z, d_w = la.gated_rms_norm_backward(d_h.reshape(T, Hv, dv), core, z, W[f"{p}.norm.weight"],
                                                  cfg.rms_norm_eps, gate)
    keep(f"{p}.norm.weight", d_w)
    grads.add(f"{p}.core_attn_out", d_core)
    # the delta rule, token by token in reverse, from the convolved q, k, v (recomputed) and zero states
    kernel = W[f"{p}.conv1d.weight"][:, 0]                                               # (C, W)
    conv_state = xp.zeros((1, kernel.shape[1] - 1, mixed.shape[1]), dtype=mixed.dtype)  # (1, W-1, C)
    convolved = la.causal_conv1d(mixed[None], kernel, conv_state)[0][0]                  # (T, C)
    q, k, v = la.queries_keys_values(convolved, *heads)                                  # (T, Hv, dk|dv)
    g, beta = la.decay_and_beta(a_in, b, W[f"{p}.A_log"], W[f"{p}.dt_bias"])             # (T, Hv) each
    state = xp.zeros((1, Hv, dk, dv), dtype=q.dtype)
    d_q, d_k, d_v, d_g, d_beta, _ = la.recurrent_gated_delta_rule_backward(
        d_core[None], q[None], k[None], v[None], g[None], beta[None], state)
    d_convolved = la.queries_keys_values_backward(d_q[0], d_k[0], d_v[0], convolved, *heads)   # (T, C)
    d_mixed, d_kernel, _ = la.causal_conv1d_backward(d_convolved[None], mixed[None], kernel, conv_state)
    keep(f"{p}.conv1d.weight", d_kernel[:, None, :])                                     # (C, 1, W)
    d_a_in, d_b, d_A_log, d_dt_bias = la.decay_and_beta_backward(d_g[0], d_beta[0], a_in, b, W[f"{p}.A_log"],
                                                                 W[f"{p}.dt_bias"])
    keep(f"{p}.A_log", d_A_log)
    keep(f"{p}.dt_bias", d_dt_bias)
    # the four input projections (Qwen3-Next: two, their gradients put back in grouped order)
    d_a = xp.zeros_like(a)
    projections = (("in_proj_qkv", d_mixed[0]), ("in_proj_z", d_z.reshape(T, Hv * dv)), ("in_proj_b", d_b),
                   ("in_proj_a", d_a_in))
    if cfg.qwen3_next:
        projections = tuple(zip(("in_proj_qkvz", "in_proj_ba"), la.ungroup_qwen3_next_backward(
            d_mixed[0], d_z.reshape(T, Hv * dv), d_b, d_a_in, *heads)))
    for name, d in projections:
        d = d.astype(a.dtype)
        grads.add(f"{p}.{name}", d)
        d_x, d_w = linear_backward(grads, f"{p}.{name}", d, a, W[f"{p}.{name}.weight"])
        keep(f"{p}.{name}.weight", d_w)
        d_a += d_x
    return d_a


