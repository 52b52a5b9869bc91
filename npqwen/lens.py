"""Reading the residual stream: the logit lens and direct logit attribution.

The residual stream is a running sum: x = embed + sum over layers of (attention + MLP), each
block adding its o_proj and down_proj outputs. The model reads it once, at the end, through the
final norm and lm_head.

- Logit lens (nostalgebraist): read it after every block as if it were the end,
  softmax(lm_head(norm(x_i))): what the model "would say" at layer i. The last layer's lens is
  the model's own distribution.
- Direct logit attribution (as TransformerLens does it): with the final norm's scale taken from
  the actual run, norm(x) @ u = sum of (part * g / rms(x)) @ u over the parts of the sum, so each
  part's share of a token's logit (u = lm_head row of the target, minus the contrast's) is one
  dot product, and the shares add up to the logit. A layer's attention splits into its heads:
  o_proj(out) = sum_h out_h @ o_proj[:, h]^T.

Shapes: L layers, T positions, k top tokens, D hidden, H heads, Dh head dim.
"""
from dataclasses import dataclass

import numpy as np

from . import hyper_connections as hc
from . import ops
from .backend import to_numpy
from .errors import NpqwenError
from .model import check_lm_head
from .weights import as_array


@dataclass
class LogitLens:
    """Each layer's lens at each position: its top-k tokens and their probabilities, and what it gives the
    token that actually comes next (position t's lens of token t + 1)."""
    token_ids: list[int]     # the prompt's T tokens
    top_ids: np.ndarray      # (L, T, k) most probable first
    top_probs: np.ndarray    # (L, T, k)
    next_probs: np.ndarray   # (L, T - 1) the probability of the next token
    next_ranks: np.ndarray   # (L, T - 1) its rank (0: the lens's top token)


def lens_logits(llm, block_output):
    """lm_head(norm(x)) (T, V) for one block's output x (T, D), as the model computes its last one. Qwen4-Exp:
    its C streams x (T, C*D) mixed into one by the final hyper_connection_mixer, which takes the final norm's place."""
    check_lm_head(llm.model)
    W, cfg = llm.weights, llm.config
    head = W["lm_head.weight"]                                                              # (V, D)
    if cfg.qwen4_exp:
        W, p = llm.model.weights, "model.hyper_connection_mixer"   # the names the model reads (not as stored)
        x, _ = hc.mix_streams(llm.model.xp.asarray(block_output), W[f"{p}.hc_norm.weight"],
                              W[f"{p}.input_mix_weight_down.weight"], W[f"{p}.input_mix_weight_up.weight"],
                              cfg.hc_count, cfg.rms_norm_eps)                               # (T, D)
        return to_numpy(ops.linear(x, head))
    x = ops.rms_norm(llm.model.xp.asarray(block_output), W["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_offset)
    return to_numpy(ops.linear(x, head))


def logit_lens(llm, prompt, top_k: int = 5) -> LogitLens:
    """The logit lens of every decoder layer at every position of `prompt` (text or token ids)."""
    ids = llm.prompt_ids(prompt)
    L = llm.config.num_hidden_layers
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= llm.config.vocab_size:
        raise NpqwenError(f"top_k must be an integer from 1 to the vocabulary size, got {top_k!r}")
    _, cache = llm.run_with_cache(ids, names=[f"model.layers.{i}" for i in range(L)])
    nxt = np.asarray(ids[1:])
    top_ids, top_probs, next_probs, next_ranks = [], [], [], []
    for i in range(L):   # one layer at a time: (T, V) at most
        logits = lens_logits(llm, cache[f"model.layers.{i}"]).astype(np.float64)          # (T, V)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]                         # (T, k)
        top_ids.append(top)
        top_probs.append(np.take_along_axis(probs, top, -1))
        p_next = probs[np.arange(len(nxt)), nxt]                                            # (T - 1,)
        next_probs.append(p_next)
        next_ranks.append((probs[:len(nxt)] > p_next[:, None]).sum(-1))
    return LogitLens(ids, np.stack(top_ids), np.stack(top_probs), np.stack(next_probs), np.stack(next_ranks))


def token_lens(llm, block_outputs, token: int) -> tuple[np.ndarray, np.ndarray]:
    """(probability (L,), rank (L,)) that each layer's lens gives `token`, from the L block outputs (L, D)
    at the position that predicts it (the web page's layers view)."""
    logits = lens_logits(llm, block_outputs).astype(np.float64)                            # (L, V)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    p = probs[:, token]
    return p, (probs > p[:, None]).sum(-1)


@dataclass
class Attribution:
    """The shares of one logit (target minus contrast) at one position; embed + attn.sum() + mlp.sum() = logit."""
    logit: float             # the run's own logit of target (minus contrast's)
    embed: float             # the embedding's share
    attn: np.ndarray         # (L,) each layer's attention
    mlp: np.ndarray          # (L,) each layer's MLP (Qwen3-MoE: its experts; Qwen3.5-MoE: and its shared expert)
    heads: np.ndarray        # (L, H) each head's share of its layer's attention; in a hybrid model a linear
    #                          layer's row holds its Hv value heads, and rows end in zeros past a layer's heads


def token_id(llm, token) -> int:
    """A token given as an id or as text that is exactly one token."""
    if isinstance(token, str):
        ids = llm.prompt_ids(token)
        if len(ids) != 1:
            raise NpqwenError(f"{token!r} is {len(ids)} tokens; name one token (its text or its id)")
        return ids[0]
    return int(llm.prompt_ids([token])[0])


def block_names(cfg, i: int) -> list[str]:
    """What layer i's shares are computed from: its attention's output and per-head input, its MLP's parts."""
    p = f"model.layers.{i}"
    if cfg.is_linear_layer(i):   # Gated DeltaNet: out_proj reads the gated norm's Hv value heads
        attn = [f"{p}.linear_attn.norm", attention_output(cfg, i)]
    else:                        # Qwen3.5 also: q_proj, whose rows hold each head's output gate
        attn = [f"{p}.self_attn.attn_output", attention_output(cfg, i)]
        attn += [f"{p}.self_attn.q_proj"] if cfg.hybrid else []
    if not cfg.is_moe_layer(i):
        return attn + [f"{p}.mlp.down_proj"]
    shared = [f"{p}.mlp.shared_expert_gate", f"{p}.mlp.shared_expert.down_proj"] \
        if cfg.shared_expert_intermediate_size else []                   # Qwen3.5-MoE / Qwen3-Next
    return attn + [f"{p}.mlp.experts"] + shared


def attention_output(cfg, i: int) -> str:
    """The step that is layer i's attention output: o_proj, or a Gated DeltaNet layer's out_proj."""
    return f"model.layers.{i}." + ("linear_attn.out_proj" if cfg.is_linear_layer(i) else "self_attn.o_proj")


def head_shares(llm, row, i: int, direction) -> np.ndarray:
    """Each head's share of layer i's attention along `direction` (D,): its slice of the output projection's
    input times that slice of the weight. A full-attention layer has H query heads (Qwen3.5: each scaled by its
    output gate first), a Gated DeltaNet layer Hv value heads."""
    cfg, W, p = llm.config, llm.model.weights, f"model.layers.{i}"
    if cfg.is_linear_layer(i):
        out, w = row(f"{p}.linear_attn.norm"), W[f"{p}.linear_attn.out_proj.weight"]             # (Hv, dv)
    else:
        H, Dh = llm.model.heads, cfg.head_dim
        out, w = row(f"{p}.self_attn.attn_output").reshape(H, Dh), W[f"{p}.self_attn.o_proj.weight"]   # (H, Dh)
        if cfg.hybrid:   # the gate: the second Dh of each head's 2*Dh q_proj values
            out = out / (1.0 + np.exp(-row(f"{p}.self_attn.q_proj").reshape(H, 2 * Dh)[:, Dh:]))
    wo = to_numpy(as_array(w)).astype(np.float64).reshape(-1, *out.shape)                         # (D, heads, d)
    return np.einsum("hd,ehd,e->h", out, wo, direction)


def logit_attribution(llm, prompt, target, contrast=None, position: int = -1) -> Attribution:
    """Direct logit attribution of `target` (minus `contrast`) at `position` of `prompt`, the final norm's
    scale taken from the run."""
    cfg, W, L = llm.config, llm.model.weights, llm.config.num_hidden_layers
    if cfg.qwen4_exp:
        raise NpqwenError("direct logit attribution splits the final residual into a sum read through one norm; "
                          "Qwen4-Exp's residual is hc_count streams mixed by a learned sigmoid gate (not a sum's "
                          "linear read-out), so it has no such split; use the logit lens or attribution patching")
    t = token_id(llm, target)
    names = ["model.embed_tokens", f"model.layers.{L - 1}"] + [n for i in range(L) for n in block_names(cfg, i)]
    logits, cache = llm.run_with_cache(prompt, names=names)
    row = lambda name: cache[name][position].astype(np.float64)   # noqa: E731   that step's row at that position
    U = llm.model.lm_head_weight()                                    # (V, D)
    u = lm_head_row(llm, U, t)
    logit = float(to_numpy(logits)[position, t])
    if contrast is not None:
        c = token_id(llm, contrast)
        u = u - lm_head_row(llm, U, c)
        logit -= float(to_numpy(logits)[position, c])
    x = row(f"model.layers.{L - 1}")                                  # (D,) the final residual stream
    scale = 1.0 / np.sqrt(np.mean(x * x) + cfg.rms_norm_eps)          # the final norm's, from this run
    weight = cfg.norm_offset + to_numpy(W["model.norm.weight"]).astype(np.float64)   # Qwen3.5: 1 + weight
    direction = scale * weight * u                                    # (D,)
    shares = [head_shares(llm, row, i, direction) for i in range(L)]
    heads = np.zeros((L, max(len(h) for h in shares)))                # a row's heads, then zeros
    for i, h in enumerate(shares):
        heads[i, :len(h)] = h
    return Attribution(logit, float(row("model.embed_tokens") @ direction),
                       np.array([row(attention_output(cfg, i)) @ direction for i in range(L)]),
                       np.array([mlp_output(cfg, row, i) @ direction for i in range(L)]), heads)


def lm_head_row(llm, U, t: int) -> np.ndarray:
    """Row t of lm_head (D,) in float64: only that row is read (widened, for a compact weight)."""
    return to_numpy(ops.embed(U, llm.model.xp.asarray([t]))[0]).astype(np.float64)


def mlp_output(cfg, row, i: int):
    """Layer i's MLP output (D,) at the position: down_proj's, or the experts' plus the gated shared expert's."""
    p = f"model.layers.{i}.mlp"
    if not cfg.is_moe_layer(i):
        return row(f"{p}.down_proj")
    if not cfg.shared_expert_intermediate_size:
        return row(f"{p}.experts")
    gate = 1.0 / (1.0 + np.exp(-row(f"{p}.shared_expert_gate")))    # (1,) the shared expert's sigmoid gate
    return row(f"{p}.experts") + gate * row(f"{p}.shared_expert.down_proj")
