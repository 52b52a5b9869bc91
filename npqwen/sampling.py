"""Choosing the next token from logits: one small pure function per step, on host NumPy arrays.

Order, as transformers' generate: repetition penalty -> presence and frequency penalties
(OpenAI's) -> temperature -> top-k -> top-p -> min-p -> draw. A filtered-out token gets logit
-inf. Temperature 0 means greedy: the argmax of the penalised logits.

`candidates` returns the distribution the draw uses; `logprobs` reads the chosen token's log
probability and the most likely alternatives from it (what the OpenAI API's logprobs report).
"""
import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checks import is_integer
from .errors import NpqwenError

# Penalised logits are clipped to float32's range: a huge penalty pushes a token as far down (or up)
# as a logit can go, but never to -inf/inf, which would read as "filtered out" (or give nan).
LOGIT_MIN, LOGIT_MAX = float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)


def is_number(value) -> bool:
    """A Python or NumPy real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0: greedy; else logits / temperature
    top_k: int = 0                    # keep the k largest logits (ties at the k-th kept); 0: off
    top_p: float = 1.0                # keep the smallest set whose probability reaches top_p; 1: off
    min_p: float = 0.0                # drop tokens below min_p * p(most likely); 0: off
    repetition_penalty: float = 1.0   # divide (multiply if negative) logits of tokens already seen; 1: off
    presence_penalty: float = 0.0     # subtract from logits of tokens already generated; 0: off
    frequency_penalty: float = 0.0    # subtract this times how often each token was generated; 0: off
    seed: int | None = None           # for a reproducible draw

    def __post_init__(self):
        # Python or NumPy numbers (np.float32(0.5), np.int64(3)) are stored as Python float / int;
        # a bool is refused: True is an int to Python but never a sampling value.
        def number(name, value):
            if not is_number(value) or not math.isfinite(value):
                raise NpqwenError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            number(name, getattr(self, name))
        if self.temperature < 0:
            raise NpqwenError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise NpqwenError(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise NpqwenError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if not 0 <= self.min_p <= 1:
            raise NpqwenError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise NpqwenError(f"repetition_penalty must be > 0 (1 turns it off), got {self.repetition_penalty}")
        if self.seed is not None:
            if not is_integer(self.seed) or self.seed < 0:
                raise NpqwenError(f"seed must be a non-negative integer, got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def read_generation_config(directory) -> dict:
    """Sampling defaults and eos ids from generation_config.json, as transformers reads them.

    Without do_sample true, transformers decodes greedily, and so do we (temperature 0).
    """
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NpqwenError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise NpqwenError(f"{path}: expected a JSON object of generation settings, got a {type(raw).__name__}; "
                          f"fix or delete the file")

    def get(key, default=None):   # null means unset, as transformers reads it
        value = raw.get(key)
        return default if value is None else value

    out = {}
    if get("do_sample"):
        out["temperature"] = get("temperature", 1.0)
        out["top_k"] = get("top_k", 50)          # transformers' default when the file has none
        out["top_p"] = get("top_p", 1.0)
        if get("min_p") is not None:
            out["min_p"] = raw["min_p"]
    if get("repetition_penalty") is not None:
        out["repetition_penalty"] = raw["repetition_penalty"]
    try:
        SamplingParams(**out)   # a bad value is reported now, with the file's name, not at every generation
    except NpqwenError as e:
        raise NpqwenError(f"{path}: {e}; fix the file or delete the key") from e
    eos = get("eos_token_id")
    if eos is not None:
        eos = [eos] if not isinstance(eos, list) else eos
        if not eos or not all(is_integer(i) and i >= 0 for i in eos):
            raise NpqwenError(f"{path}: eos_token_id must be a token id or a list of token ids, got "
                              f"{raw['eos_token_id']!r}; fix the file or delete the key")
        out["eos_token_id"] = eos
    return out


def sampling_params(defaults: dict, **overrides) -> SamplingParams:
    """Checkpoint defaults, overridden by every argument that is not None."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    values = {k: v for k, v in defaults.items() if k in fields}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)


def repetition_penalty(logits, seen_ids, penalty: float):
    """Tokens already in the sequence (prompt included): logit / penalty if > 0, else * penalty."""
    if penalty == 1.0 or len(seen_ids) == 0:
        return logits
    idx = np.unique(np.asarray(seen_ids))
    out = logits.copy()
    picked = out[idx].astype(np.float64)
    with np.errstate(over="ignore"):   # a huge penalty: clipped to the float32 range below
        penalised = np.where(picked < 0, picked * penalty, picked / penalty)
    out[idx] = np.clip(penalised, LOGIT_MIN, LOGIT_MAX)
    return out


def presence_penalty(logits, generated_ids, penalty: float):
    """Tokens generated so far (not the prompt) lose `penalty`, once however often they appeared (OpenAI's rule)."""
    if penalty == 0.0 or len(generated_ids) == 0:
        return logits
    idx = np.unique(np.asarray(generated_ids))
    out = logits.copy()
    out[idx] = np.clip(out[idx].astype(np.float64) - penalty, LOGIT_MIN, LOGIT_MAX)
    return out


def frequency_penalty(logits, generated_ids, penalty: float):
    """Tokens generated so far lose `penalty` once per time they appeared (OpenAI's rule)."""
    if penalty == 0.0 or len(generated_ids) == 0:
        return logits
    idx, counts = np.unique(np.asarray(generated_ids), return_counts=True)
    out = logits.copy()
    out[idx] = np.clip(out[idx].astype(np.float64) - penalty * counts, LOGIT_MIN, LOGIT_MAX)
    return out


def temperature(logits, t: float):
    return logits / t


def kth_largest(logits, k: int):
    """The k-th largest logit: top-k keeps every logit >= it (ties with the k-th included)."""
    return np.partition(logits, -k)[-k]


def top_k(logits, k: int):
    """Keep the k largest logits and any tied with the k-th."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    return np.where(logits < kth_largest(logits, k), -np.inf, logits)


def top_p(logits, p: float):
    """Nucleus: keep the most likely tokens up to and including the one whose cumulative probability crosses p."""
    if p >= 1.0:
        return logits
    order = np.argsort(logits, kind="stable")                   # ascending, as transformers sorts
    cumulative = np.cumsum(softmax(logits[order]))
    remove = cumulative <= 1 - p
    remove[-1] = False                                          # always keep the most likely token
    out = logits.copy()
    out[order[remove]] = -np.inf
    return out


def min_p(logits, p: float):
    """Drop tokens whose probability is below p times the top token's."""
    if p <= 0.0:
        return logits
    probs = softmax(logits)
    keep = probs >= p * probs.max()
    keep[np.argmax(probs)] = True
    return np.where(keep, logits, -np.inf)


def softmax(logits):
    e = np.exp(logits - logits.max())
    return e / e.sum()


def candidates(logits, params: SamplingParams, prompt_ids=(), generated_ids=(), allowed=None):
    """(token ids, their float64 logits) after penalties, temperature and filters: the distribution
    the draw uses (-inf: filtered out). Greedy keeps every token and temperature 1. `allowed`, a
    constraint's mask (V,) bool (structured.py), keeps only those tokens, before temperature,
    top-k, top-p and min-p, so they choose among the allowed tokens only."""
    logits = np.asarray(logits, dtype=np.float32)
    # Only build the list of seen tokens (prompt included) when a penalty will read it.
    seen = list(prompt_ids) + list(generated_ids) if params.repetition_penalty != 1.0 else ()
    logits = repetition_penalty(logits, seen, params.repetition_penalty)
    logits = presence_penalty(logits, generated_ids, params.presence_penalty)
    logits = frequency_penalty(logits, generated_ids, params.frequency_penalty)
    ids = np.arange(logits.shape[-1])
    if allowed is not None:
        # Work on the allowed tokens only: a penalty acts on each token alone, so masking before or
        # after them is the same, and at a JSON comma a handful of tokens is all there is to sort.
        ids = np.flatnonzero(allowed)
        logits = logits[ids]
    if params.greedy:
        return ids, logits.astype(np.float64)
    # Divide after subtracting the max, in float64: the top token stays at 0 and a tiny temperature
    # (1e-38) sends the others far down (near-greedy) instead of overflowing every logit to inf.
    with np.errstate(over="ignore"):
        logits = np.maximum(temperature(logits.astype(np.float64) - logits.max(), params.temperature), -1e300)
    if 0 < params.top_k < logits.shape[-1]:
        # Work on the k survivors only: the filters below give the same result on them as on
        # the full vocabulary with -inf elsewhere, and sorting 20 values beats sorting 151936.
        keep = np.flatnonzero(logits >= kth_largest(logits, params.top_k))   # the top_k() survivors
        ids, logits = ids[keep], logits[keep]
    return ids, min_p(top_p(logits, params.top_p), params.min_p)


def choose(logits, params: SamplingParams, rng, prompt_ids=(), generated_ids=()) -> int:
    """The next token id from one position's logits (V,)."""
    return draw(*candidates(logits, params, prompt_ids, generated_ids), params, rng)


def draw(ids, logits, params: SamplingParams, rng) -> int:
    """One token from candidates' (ids, logits): the most likely when greedy, else a random draw."""
    if params.greedy:
        return int(ids[np.argmax(logits)])
    probs = softmax(logits)
    return int(ids[min(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"),
                       len(ids) - 1)])


def logprobs(ids, logits, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log p(token), the `top` most likely (id, log p), most likely first) under candidates' distribution."""
    logp = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))   # log-softmax
    at = np.flatnonzero(ids == token)
    chosen = float(logp[at[0]]) if at.size else -math.inf
    order = np.argsort(-logp, kind="stable")[:top]
    return chosen, [(int(ids[j]), float(logp[j])) for j in order if np.isfinite(logp[j])]


def score_rows(logits, targets, top: int, block: int = 32) -> list[tuple[float, list[tuple[int, float]], int]]:
    """For each row of logits (R, V) and its target token: (log p(target), the `top` most likely
    (id, log p), most likely first, the target's rank: 1 + how many tokens are more likely), under
    the model's own distribution (log-softmax of the raw logits: no penalty, temperature or filter).
    This scores given text (prompt logprobs, llm.score); float64, `block` rows at a time."""
    out = []
    for b in range(0, len(targets), block):
        x = np.asarray(logits[b:b + block], dtype=np.float64)                              # (B, V)
        m = x.max(axis=1, keepdims=True)
        logp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))                   # log-softmax
        t = np.asarray(targets[b:b + block])
        chosen = logp[np.arange(len(t)), t]                                                 # (B,)
        ranks = (logp > chosen[:, None]).sum(axis=1) + 1
        k = min(top, logp.shape[1])
        best = np.argpartition(-logp, k - 1, axis=1)[:, :k] if k else np.empty((len(t), 0), np.int64)
        for row, ids in enumerate(best):
            ids = ids[np.argsort(-logp[row, ids], kind="stable")]
            out.append((float(chosen[row]), [(int(i), float(logp[row, i])) for i in ids], int(ranks[row])))
    return out
