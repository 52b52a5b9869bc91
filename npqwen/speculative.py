"""Speculative decoding: propose, verify, accept, roll back.

    llm.generate(prompt, max_new_tokens=64, temperature=0, speculative={"method": "ngram", "k": 4})

A decoding step computes one token per sequence and reads every weight once to do it; on a machine
bound by reading weights, computing k+1 tokens in the same pass costs little more. So a request
that speculates guesses k tokens ahead (propose), runs its last token and the k guesses as one
chunk of the step's packed batch (verify: k+1 logits rows), keeps the guesses the model agrees
with plus one token of its own (accept), and forgets the keys/values and linear-attention states
of the guesses it refused (roll back). The engine does the four steps (Engine.step); this file
holds the request's settings and the pure functions: the proposer and the acceptance rule.

Drafts (`method`):
  "ngram": prompt lookup (transformers' prompt_lookup_num_tokens, vLLM's "ngram"): the longest
           n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that ends the sequence and
           occurred earlier in it (prompt and output); the k tokens that followed its latest
           earlier occurrence are the drafts. Free, and good where the answer copies the prompt.
  "mtp":   Qwen3.5's multi-token-prediction head (npqwen/mtp.py), run k times in a chain.

Exact. Greedy: a draft is kept when it is the argmax of its row, so the output is token for token
the output without drafts. Sampling: Leviathan et al. (2023)'s rule with the draft distribution q
a point mass at the draft x (both proposers are deterministic): keep x with probability
min(1, p(x)/q(x)) = p(x); else draw from max(0, p - q) renormalised, which is p with x removed.
Every token is then distributed as p, the distribution sampling without drafts draws from
(tests/test_speculative.py checks it with a chi-square test).
"""
from dataclasses import dataclass

import numpy as np

from .checks import is_integer
from .errors import NpqwenError

METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class Speculative:
    """A request's speculative decoding, with vLLM's speculative_config names (k: num_speculative_tokens)."""
    method: str                      # "ngram" (prompt lookup) or "mtp" (Qwen3.5's MTP head)
    num_speculative_tokens: int = 4  # k: drafts per step
    prompt_lookup_max: int = 3       # ngram: the longest n-gram matched
    prompt_lookup_min: int = 1       # ngram: the shortest

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def speculative_of(value) -> Speculative | None:
    """A checked Speculative from a dict ({"method": "ngram", "k": 4}; "num_speculative_tokens" is k's
    vLLM name), a Speculative, or None (no speculation)."""
    if value is None or isinstance(value, Speculative):
        return value
    if not isinstance(value, dict):
        raise NpqwenError(f'speculative must be a dict like {{"method": "ngram", "k": 4}}, got {value!r}')
    fields = dict(value)
    if "k" in fields:
        if "num_speculative_tokens" in fields:
            raise NpqwenError("speculative: give k or num_speculative_tokens, not both")
        fields["num_speculative_tokens"] = fields.pop("k")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise NpqwenError(f"speculative: unknown field(s) {', '.join(unknown)}; known: method, k "
                          f"(num_speculative_tokens), prompt_lookup_max, prompt_lookup_min")
    if fields.get("method") not in METHODS:
        raise NpqwenError(f"speculative: method must be one of {', '.join(METHODS)}, got {fields.get('method')!r}")
    for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        if name in fields and (not is_integer(fields[name]) or not 1 <= fields[name] <= 64):
            raise NpqwenError(f"speculative: {name} must be an integer in [1, 64], got {fields[name]!r}")
    spec = Speculative(**{k: (v if k == "method" else int(v)) for k, v in fields.items()})
    if spec.prompt_lookup_min > spec.prompt_lookup_max:
        raise NpqwenError(f"speculative: prompt_lookup_min ({spec.prompt_lookup_min}) > prompt_lookup_max "
                          f"({spec.prompt_lookup_max})")
    return spec


def propose_ngram(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Prompt lookup: up to k tokens that followed the latest earlier occurrence of the longest n-gram
    (n_max down to n_min tokens) that ends `tokens`; [] when none occurred before."""
    ids = np.asarray(tokens)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)      # (len - n, n): ids[i:i+n], each start
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))             # earlier places the last n tokens occur
        if len(hits):
            start = hits[-1] + n                                             # the token after the latest one
            return ids[start:start + k].tolist()
    return []


def accept_or_replace(ids, logits, draft: int | None, greedy: bool, rng, draw) -> tuple[int, bool]:
    """(the token this position keeps, whether it is the draft): the rejection rule for a draft that was
    certain (q a point mass). ids, logits: the position's candidates (sampling.candidates), the
    distribution p a token is drawn from; draw(ids, logits, rng) draws from them. draft None: no draft
    here (the bonus token after every draft was kept): a plain draw."""
    if draft is None:
        return draw(ids, logits, rng), False
    if greedy:   # the argmax, drafted or not: exactly the token decoding without drafts picks
        token = draw(ids, logits, rng)
        return token, token == draft
    at = np.flatnonzero(ids == draft)
    probs = np.exp(logits - logits.max())                                   # (n,) p, unnormalised
    p = float(probs[at[0]] / probs.sum()) if at.size else 0.0              # p(draft)
    if rng.random() < p:                                                    # keep it with probability p(x) / q(x)
        return draft, True
    if at.size:                                                             # else draw from p with x removed
        logits = logits.copy()
        logits[at[0]] = -np.inf
    return draw(ids, logits, rng), False
