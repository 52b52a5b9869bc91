"""Choosing the next token from logits: one small pure function per step, on host NumPy arrays.

Order, as transformers' generate: repetition penalty -> presence and frequency penalties
(OpenAI's) -> temperature -> top-k -> top-p -> min-p -> draw. A filtered-out token gets logit
-inf. Temperature 0 means greedy: the argmax of the penalised logits. A value of None (not set:
SamplingParams) turns its step off, as its neutral value does (temperature: greedy).

`candidates` returns the distribution the draw uses; `logprobs` reads the chosen token's log
probability and the most likely alternatives from it (what the OpenAI API's logprobs report).
"""
import math

import numpy as np

# The request's options live in sampling_params.py; these names stay importable from here.
from .sampling_params import SamplingParams, read_generation_config, sampling_params  # noqa: F401

# Penalised logits are clipped to float32's range: a huge penalty pushes a token as far down (or up)
# as a logit can go, but never to -inf/inf, which would read as "filtered out" (or give nan).
LOGIT_MIN, LOGIT_MAX = float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)


def repetition_penalty(logits, seen_ids, penalty: float):
    """Tokens already in the sequence (prompt included): logit / penalty if > 0, else * penalty."""
    if penalty is None or penalty == 1.0 or len(seen_ids) == 0:
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
    if not penalty or len(generated_ids) == 0:
        return logits
    idx = np.unique(np.asarray(generated_ids))
    out = logits.copy()
    out[idx] = np.clip(out[idx].astype(np.float64) - penalty, LOGIT_MIN, LOGIT_MAX)
    return out


def frequency_penalty(logits, generated_ids, penalty: float):
    """Tokens generated so far lose `penalty` once per time they appeared (OpenAI's rule)."""
    if not penalty or len(generated_ids) == 0:
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
    if k is None or k <= 0 or k >= logits.shape[-1]:
        return logits
    return np.where(logits < kth_largest(logits, k), -np.inf, logits)


def top_p(logits, p: float):
    """Nucleus: keep the most likely tokens up to and including the one whose cumulative probability crosses p."""
    if p is None or p >= 1.0:
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
    if p is None or p <= 0.0:
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
    seen = list(prompt_ids) + list(generated_ids) if params.repetition_penalty not in (None, 1.0) else ()
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
    if params.top_k and params.top_k < logits.shape[-1]:
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
