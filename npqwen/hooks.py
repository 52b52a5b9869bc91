"""Look inside and touch: the cache of every activation, and hooks that change them.

    logits, cache = llm.run_with_cache("The capital of France is")
    cache["model.layers.3.mlp.act_fn"]                       # (T, F), the array that step produced

    def zero_head(out, name):                                # out: (T, H*Dh), the heads side by side
        out = out.reshape(len(out), H, -1).copy(); out[:, 5] = 0
        return out.reshape(len(out), -1)
    logits = llm.run_with_hooks(prompt, hooks={"model.layers.3.self_attn.attn_output": zero_head})

The names are `npqwen trace`'s (HF module names, npqwen/trace.py). A hook is called as
fn(array, name), as TransformerLens calls its hooks, and returns an array of the same shape and
dtype, which replaces the value from then on (patching, ablation, steering), or None to leave
it. Both are recorders (model.py): the forward pass is the same code, step for step.

The engine's speculative decoding (docs/speculative.md) has three names of its own, one per step a
forward pass does not hold; Engine(llm, hooks={name: fn}) calls them for each request that verifies
drafts, in batch order, the same way:

    speculative.propose   (k,) int64: the drafts it proposed (1. propose); a returned array replaces them
    speculative.verify    (1 + k, V) float32: its rows of the verification (2. verify): the logits of its
                          last token and of each draft, before sampling; a returned array replaces them
    speculative.accept    (k,) bool: which drafts it kept (3. accept: the first ones); read only
"""
import difflib
from collections.abc import Callable

import numpy as np

from .backend import to_numpy
from .errors import NpqwenError

SEEN_ONLY = ("self_attn.attn_probs", "mlp.gate", "speculative.accept")   # recorded after they were used: read only
SPECULATIVE = ("speculative.propose", "speculative.verify", "speculative.accept")   # the engine's (Engine(hooks=))


def step_names(config) -> list[str]:
    """Every name a forward pass of this model records, in order."""
    names = ["model.embed_tokens", "model.rotary_emb.cos", "model.rotary_emb.sin"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        norms = ("q_norm", "k_norm") if config.qk_norm else ()   # Qwen2 has no QK-norm
        qsa = ("indexer",) if config.qwen4_exp else ()   # Qwen4-Exp: the QSA indexer's selection (T, S)
        attn = [f"{p}.self_attn.{s}" for s in ("q_proj", "k_proj", "v_proj", *norms, "q_rope", "k_rope", *qsa,
                                                "attn_probs", "attn_output", "o_proj")]
        if config.is_linear_layer(i):   # Qwen3.5 / Qwen3-Next: Gated DeltaNet (model.linear_attn)
            projections = ("in_proj_qkvz", "in_proj_ba") if config.qwen3_next else \
                ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")   # HF's modules: two in Qwen3-Next, four in 3.5
            attn = [f"{p}.linear_attn.{s}" for s in (*projections, "core_attn_out", "norm", "out_proj")]
        mlp = ["gate", "gate.top_k_index", "gate.top_k_weights", "experts"] if config.is_moe_layer(i) else \
            ["gate_proj", "up_proj", "act_fn", "down_proj"]
        if config.is_moe_layer(i) and config.shared_expert_intermediate_size:   # Qwen3.5-MoE's shared expert
            mlp += ["shared_expert_gate"] + [f"shared_expert.{s}" for s in ("gate_proj", "up_proj", "act_fn",
                                                                            "down_proj")]
        if config.qwen4_exp:   # hyper-connections mix the streams where Qwen3 normalises; PLE first on some layers
            names += [*([f"{p}.ple"] if config.is_ple_layer(i) else []), f"{p}.attn_hyper_connection", *attn,
                      f"{p}.attn_residual", f"{p}.mlp_hyper_connection", *[f"{p}.mlp.{s}" for s in mlp], p]
            continue
        names += [f"{p}.input_layernorm", *attn, f"{p}.attn_residual", f"{p}.post_attention_layernorm",
                  *[f"{p}.mlp.{s}" for s in mlp], p]
    return names + (["model.hyper_connection_mixer"] if config.qwen4_exp else ["model.norm"]) + ["lm_head"]


def residual_width(config) -> int:
    """The width of a block's output (model.layers.L, the residual stream): D, or on Qwen4-Exp its C = hc_count
    streams of D side by side (C*D), as hooks, trace and the logit lens see it."""
    return config.hidden_size * (config.hc_count if config.qwen4_exp else 1)


def check_names(names, config, what: str = "hook", known: list[str] | None = None):
    """An error naming the first unknown name and the nearest known ones (of `known`, default step_names)."""
    where = "npqwen.hooks.step_names(llm.config) lists them" if known is None else \
        f"an engine's are {', '.join(known)}; a forward pass's are llm.run_with_hooks's"
    known = step_names(config) if known is None else list(known)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(str(name), known, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(near)}?" if near else \
                f"; the names are npqwen trace's ({where})"
            raise NpqwenError(f"unknown {what} name {name!r}{hint}")


class Cache(dict):
    """A recorder that keeps a host copy of the arrays it is asked for: cache[name]; keep=None keeps all."""

    def __init__(self, keep=None):
        super().__init__()
        self.keep = keep if keep is None or callable(keep) else set(keep).__contains__

    def __call__(self, name: str, array):
        if array is not None and (self.keep is None or self.keep(name)):
            self[name] = np.array(to_numpy(array), copy=True)


class Hooks:
    """A recorder that calls each name's hooks in turn; a returned array, checked, replaces the value."""

    def __init__(self, hooks, config, known: list[str] | None = None):
        pairs = list(hooks.items()) if isinstance(hooks, dict) else list(hooks)   # {name: fn} or [(name, fn)]
        check_names([name for name, _ in pairs], config, known=known)
        self.hooks: dict[str, list[Callable]] = {}
        for name, fn in pairs:
            if not callable(fn):
                raise NpqwenError(f"the hook on {name} is {type(fn).__name__}, not a function fn(array, name)")
            self.hooks.setdefault(name, []).append(fn)

    def __call__(self, name: str, array):
        for fn in self.hooks.get(name, ()):
            array = self.apply(fn, name, array)
        return array

    @staticmethod
    def apply(fn, name: str, array):
        """fn(array, name), checked: the same shape and dtype as the value it replaces, or None."""
        label = f"hook {getattr(fn, '__name__', repr(fn))} on {name}"
        try:
            new = fn(array, name)
        except NpqwenError:
            raise
        except Exception as e:
            raise NpqwenError(f"{label} raised {type(e).__name__}: {e}") from e
        if new is None or new is array:
            return array
        if name.endswith(SEEN_ONLY):
            raise NpqwenError(f"{label} returned a value, but {name} is recorded after it was used: a hook may "
                              f"read it, not replace it")
        if type(new) is not type(array):
            raise NpqwenError(f"{label} returned {type(new).__name__}; return a {type(array).__name__} of shape "
                              f"{tuple(array.shape)} and dtype {array.dtype}, or None to leave the value")
        if new.shape != array.shape or new.dtype != array.dtype:
            raise NpqwenError(f"{label} returned shape {tuple(new.shape)} dtype {new.dtype}; it must keep "
                              f"shape {tuple(array.shape)} and dtype {array.dtype}")
        return new


def both(cache: Cache, hooks: Hooks | None):
    """One recorder: the hooks change the value, then the cache keeps what goes on."""
    if hooks is None:
        return cache

    def record(name, array):
        array = hooks(name, array)
        cache(name, array)
        return array
    return record
