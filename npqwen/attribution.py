"""Attribution with gradients (npqwen/grad.py): which tokens and which layers a value depends on.

- Gradient x input: the first-order share of each token, grad . x summed over D, at the embedding
  (per token) and at each layer's output, the residual stream (per layer and token).
- Integrated gradients (Sundararajan et al. 2017): gradient x input averaged along the straight path
  from a baseline embedding (zeros) to the real one, (x - x0) . mean_alpha grad f(x0 + alpha (x - x0));
  its shares add up to f(x) - f(x0) (completeness), which `IntegratedGradients.gap` reports.
- Attribution patching (Nanda; Syed et al. 2023): the change activation patching measures, patching a
  clean run's activation into a corrupted run at one layer and position, estimated to first order as
  (a_clean - a_corrupt) . grad_corrupt: every layer and position from one clean forward, one corrupted
  forward and one backward. `activation_patching` does the real thing (one forward per layer and position)
  to compare with.

The value is an `Objective` (grad.log_prob, grad.logit_diff, grad.loss); shapes: T tokens, L layers.
"""
from dataclasses import dataclass

import numpy as np

from . import grad
from .backend import to_numpy, xp_of
from .errors import NpqwenError
from .hooks import Cache, Hooks


@dataclass
class Saliency:
    """Gradient x input of one value: per token at the embedding, and per layer (the residual stream after
    layer i; row 0 the embedding) and token."""
    token_ids: list[int]
    value: float
    per_token: np.ndarray   # (T,)
    per_layer: np.ndarray   # (L + 1, T)

    def text(self, tokens: list[str], width: int = 20) -> str:
        """One line per token: its text and a bar as long as its share of the largest |share|."""
        top = max(float(np.abs(self.per_token).max()), 1e-30)
        return "\n".join(f"{tok!r:>14} {s:+.4f} {'#' * round(width * abs(s) / top)}"
                         for tok, s in zip(tokens, self.per_token))


def residual_names(config) -> list[str]:
    """The residual stream's names: the embedding, then each layer's output."""
    return ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(config.num_hidden_layers)]


def gradient_x_input(llm, prompt, objective: grad.Objective) -> Saliency:
    """grad . x over D for the embedding (per token) and every layer's output (per layer and token)."""
    ids = prompt_ids(llm, prompt)
    g = grad.gradients(llm, ids, objective, weights=False)
    names = residual_names(llm.config)
    per_layer = np.stack([to_numpy((g[n] * g.tape[n]).sum(-1)) for n in names]).astype(np.float64)   # (L+1, T)
    return Saliency(list(ids), g.value, per_layer[0], per_layer)


@dataclass
class IntegratedGradients:
    token_ids: list[int]
    value: float            # f(x)
    baseline_value: float   # f(x0), x0 the baseline embedding
    per_token: np.ndarray   # (T,) summed over D

    @property
    def gap(self) -> float:
        """sum(per_token) - (f(x) - f(x0)): zero for exact integration; it shrinks as steps grow."""
        return float(self.per_token.sum() - (self.value - self.baseline_value))


def integrated_gradients(llm, prompt, objective: grad.Objective, steps: int = 32, baseline=None):
    """Integrated gradients of each token's embedding, by the midpoint rule over `steps` points of the path from
    `baseline` to the embedding (a hook replaces the embedding's output by x0 + alpha (x - x0)). `baseline`: a
    token id (its embedding at every position), a (T, D) array, or None: the config's bos_token_id
    (<|endoftext|> in Qwen3), else zeros. (Zeros suit an RMSNorm model badly: the first norm jumps near 0.)"""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise NpqwenError(f"steps must be a positive integer, got {steps!r}")
    ids = prompt_ids(llm, prompt)
    run = grad.gradients(llm, ids, objective, weights=False)
    x = to_numpy(run.tape["model.embed_tokens"])                                         # (T, D)
    if baseline is None:
        baseline = llm.config.bos_token_id if llm.config.bos_token_id is not None else np.zeros_like(x)
    if isinstance(baseline, (int, np.integer)):
        baseline = np.tile(to_numpy(llm.model.weights["model.embed_tokens.weight"][int(baseline)]), (len(ids), 1))
    x0 = np.asarray(baseline, dtype=x.dtype)
    if x0.shape != x.shape:
        raise NpqwenError(f"the baseline must have the embedding's shape {x.shape}, not {x0.shape}")
    total = np.zeros(x.shape, dtype=np.float64)
    for alpha in (np.arange(steps) + 0.5) / steps:
        point = (x0 + alpha * (x - x0)).astype(x.dtype)
        g = grad.gradients(llm, ids, objective, hooks={"model.embed_tokens": lambda a, n, p=point: xp_of(a).asarray(p)},
                           weights=False)
        total += to_numpy(g["model.embed_tokens"])
    value = run.value
    at_baseline = {"model.embed_tokens": lambda a, n: xp_of(a).asarray(x0)}
    baseline_value = objective_value(objective, llm.model.forward(ids, recorder=Hooks(at_baseline, llm.config)), ids)
    return IntegratedGradients(list(ids), value, baseline_value, ((x - x0) * total / steps).sum(-1))


@dataclass
class Patching:
    """The change of the value when the clean run's residual stream replaces the corrupted run's at one
    layer (row 0: the embedding) and position, starting from the corrupted run: (L + 1, T)."""
    clean_value: float
    corrupt_value: float
    effect: np.ndarray   # (L + 1, T)


def attribution_patching(llm, clean, corrupt, objective: grad.Objective) -> Patching:
    """(a_clean - a_corrupt) . d value / d a at the corrupted run, for every residual-stream activation a: one
    clean forward, one corrupted forward and backward."""
    clean_ids, corrupt_ids = same_length(llm, clean, corrupt)
    c = grad.gradients(llm, clean_ids, objective, weights=False)
    g = grad.gradients(llm, corrupt_ids, objective, weights=False)
    effect = np.stack([to_numpy(((c.tape[n] - g.tape[n]) * g[n]).sum(-1)) for n in residual_names(llm.config)])
    return Patching(c.value, g.value, effect.astype(np.float64))


def activation_patching(llm, clean, corrupt, objective: grad.Objective) -> Patching:
    """The real thing: one corrupted forward per layer and position, with the clean activation put in there."""
    clean_ids, corrupt_ids = same_length(llm, clean, corrupt)
    names = residual_names(llm.config)
    cache = Cache(names)
    value = objective_value(objective, llm.model.forward(clean_ids, recorder=cache), clean_ids)
    base = objective_value(objective, llm.model.forward(corrupt_ids), corrupt_ids)
    effect = np.zeros((len(names), len(corrupt_ids)))
    for i, name in enumerate(names):
        for t in range(len(corrupt_ids)):
            def patch(a, n, t=t, name=name):   # position t of this step from the clean run
                a = a.copy()
                a[t] = xp_of(a).asarray(cache[name][t])
                return a
            logits = llm.model.forward(corrupt_ids, recorder=Hooks({name: patch}, llm.config))
            effect[i, t] = objective_value(objective, logits, corrupt_ids) - base
    return Patching(value, base, effect)


def objective_value(objective: grad.Objective, logits, ids) -> float:
    return (objective.fn(logits, ids) if getattr(objective.fn, "wants_ids", False) else objective.fn(logits))[0]


def prompt_ids(llm, prompt) -> list[int]:
    """Token ids of a prompt: text through the LLM's tokenizer, or ids as they are."""
    return list(llm.prompt_ids(prompt) if hasattr(llm, "prompt_ids") else prompt)


def same_length(llm, clean, corrupt):
    """The two prompts' ids; patching position by position needs as many tokens in each."""
    ids = [prompt_ids(llm, p) for p in (clean, corrupt)]
    if len(ids[0]) != len(ids[1]):
        raise NpqwenError(f"the clean and corrupted prompts must have as many tokens, to patch position by "
                          f"position: {len(ids[0])} and {len(ids[1])}")
    return ids
