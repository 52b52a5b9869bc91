"""What a request asks of generation besides its prompt: one frozen SamplingParams, checked when made.

    params = npqwen.SamplingParams(max_new_tokens=50, temperature=0.7, seed=1, stop=["\\n\\n"])
    llm.generate("Once upon a time", params)     # the same as llm.generate(..., max_new_tokens=50, ...)
    engine.add_request(prompt, params)

Every value is checked here (__post_init__), before anything runs. What needs the model (the prompt
against the context and the vocabulary, the KV pages, the constraint against the tokenizer) is
checked by the engine when it makes the request (Engine.new_request).

Defaults. A sampling value left None is not set: the engine takes the checkpoint's value from its
generation_config.json (llm.generation_defaults), in one place, `with_defaults`; what the
checkpoint does not set either is off (temperature: greedy). So SamplingParams() on Qwen3-0.6B
samples as its file says (temperature 0.6, top_k 20, top_p 0.95), as transformers' generate does,
and SamplingParams(temperature=0) is greedy on any checkpoint.
"""
import dataclasses
import difflib
import inspect
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import NpqwenError
from .checks import is_integer
from .speculative import speculative_of
from .structured import grammar_entry

DEFAULT_MAX_NEW_TOKENS = 512
# the values generation_config.json may set (None here: the checkpoint's)
CHECKPOINT_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty")


def is_number(value) -> bool:
    """A Python or NumPy real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to generate: when to stop, how to draw each token, what to report, what the answer must match."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS   # most tokens to generate (the engine caps it to the context)
    stop: tuple[str, ...] = ()        # stop strings (a string or a list is taken); the text ends before one
    # drawing a token (sampling.py); None: the checkpoint's value, else off
    temperature: float | None = None  # 0: greedy; else logits / temperature
    top_k: int | None = None          # keep the k largest logits (ties at the k-th kept); 0: off
    top_p: float | None = None        # keep the smallest set whose probability reaches top_p; 1: off
    min_p: float | None = None        # drop tokens below min_p * p(most likely); 0: off
    repetition_penalty: float | None = None   # divide (multiply if negative) logits of tokens already seen; 1: off
    presence_penalty: float | None = None     # subtract from logits of tokens already generated; 0: off
    frequency_penalty: float | None = None    # subtract this times how often each token was generated; 0: off
    seed: int | None = None           # for a reproducible draw; None: a fresh one
    # what each output reports (None: off)
    logprobs: int | None = None       # log p of each sampled token, and this many most likely alternatives
    prompt_logprobs: int | None = None   # the same for each prompt token after the first, under the raw logits
    # structured output (structured.py): at most one of the four
    json_schema: dict | bool | str | None = None   # a JSON Schema, or its JSON text
    regex: str | None = None          # the whole answer matches it
    choice: tuple[str, ...] | None = None   # the answer is one of these
    grammar: str | None = None        # llguidance's Lark, or GBNF
    thinking: bool = False            # the answer opens with Qwen3's free <think> reasoning; a constraint follows it
    thinking_budget: int | None = None   # with thinking: the most reasoning tokens, then "\n</think>\n\n" is written
                                         # for the model (engine/thinking.py); None: unlimited, but a constrained
                                         # request's reasoning ends at the latest at half its max_new_tokens
    # speculative decoding (speculative.py): {"method": "ngram" | "mtp", "k": drafts per step}; None: off
    speculative: dict | None = None   # stored as a checked speculative.Speculative
    # made here from the four above: (kind, llguidance grammar entry), None without a constraint
    constraint: tuple | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self):
        def put(name, value):   # a frozen dataclass sets its own fields this way
            object.__setattr__(self, name, value)

        if not is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise NpqwenError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        put("max_new_tokens", int(self.max_new_tokens))
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop)):
            raise NpqwenError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if stop is not None and "" in stop:   # as vLLM refuses it: "" would match before the first token
            raise NpqwenError(f"stop cannot contain an empty string (it would end the text before it began), "
                              f"got {self.stop!r}; leave it out for no stop string")
        put("stop", tuple(stop or ()))

        # Python or NumPy numbers (np.float32(0.5), np.int64(3)) are stored as Python float / int;
        # a bool is refused: True is an int to Python but never a sampling value.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                if not is_number(value) or not math.isfinite(value):
                    raise NpqwenError(f"{name} must be a finite number, got {value!r}")
                put(name, float(value))
        t, k, p, m, r = self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty
        if t is not None and t < 0:
            raise NpqwenError(f"temperature must be >= 0 (0 means greedy), got {t}")
        if p is not None and not 0 < p <= 1:
            raise NpqwenError(f"top_p must be in (0, 1], got {p}")
        if k is not None:
            if not is_integer(k) or k < 0:
                raise NpqwenError(f"top_k must be an integer >= 0 (0 turns it off), got {k!r}")
            put("top_k", int(k))
        if m is not None and not 0 <= m <= 1:
            raise NpqwenError(f"min_p must be in [0, 1], got {m}")
        if r is not None and r <= 0:
            raise NpqwenError(f"repetition_penalty must be > 0 (1 turns it off), got {r}")
        if self.seed is not None:
            if not is_integer(self.seed) or self.seed < 0:
                raise NpqwenError(f"seed must be a non-negative integer, got {self.seed!r}")
            put("seed", int(self.seed))

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                if not is_integer(value) or value < 0:
                    raise NpqwenError(f"{name} must be None or an integer >= 0 (alternatives per token), got {value!r}")
                put(name, int(value))

        # the constraint's values (the schema, regex or grammar itself is checked when its matcher is made)
        put("constraint", grammar_entry(self.json_schema, self.regex, self.choice, self.grammar))
        if self.choice is not None:
            put("choice", tuple(self.choice))
        put("thinking", bool(self.thinking))
        if self.thinking_budget is not None:
            if not is_integer(self.thinking_budget) or self.thinking_budget < 0:
                raise NpqwenError(f"thinking_budget must be None or an integer >= 0 (reasoning tokens), got "
                                  f"{self.thinking_budget!r}")
            put("thinking_budget", int(self.thinking_budget))
        put("speculative", speculative_of(self.speculative))

    @property
    def greedy(self) -> bool:
        return not self.temperature   # 0, or not set

    def with_defaults(self, defaults: dict) -> "SamplingParams":
        """These params with the checkpoint's values (llm.generation_defaults, read from its
        generation_config.json) in place of the sampling values not set (None). The engine calls it
        once per request; what is still None after it is off."""
        unset = {k: defaults[k] for k in CHECKPOINT_FIELDS if defaults.get(k) is not None and getattr(self, k) is None}
        return dataclasses.replace(self, **unset) if unset else self


def params_of(params, keywords: dict, called=None) -> SamplingParams:
    """The SamplingParams of a call that takes one (`params`) or, as before it existed, its fields as
    keyword arguments, which build it; a number in its place is max_new_tokens (add_request(prompt, 20)).
    `called` is the function the keywords were given to: a keyword that is no field names it, with the
    nearest of its own parameters and the fields (llm.generate("hi", tempreature=0): did you mean temperature?)."""
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = [k for k in keywords if k not in fields]
    if unknown:
        own = [] if called is None else [p for p in inspect.signature(called).parameters if p not in ("self", "sampling")]
        near = difflib.get_close_matches(unknown[0], own + fields, n=1)
        raise NpqwenError(f"{called.__qualname__ if called else 'SamplingParams'}() got an unexpected keyword "
                          f"argument {unknown[0]!r}" + (f"; did you mean {near[0]}?" if near else
                                                         f" (the sampling values: {', '.join(fields)})"))
    if isinstance(params, SamplingParams):
        if keywords:
            raise NpqwenError(f"give the sampling values as params or as keyword arguments, not both: got params "
                              f"and {', '.join(keywords)}")
        return params
    if params is not None:
        if not isinstance(params, (numbers.Real, np.bool_)):   # a number that is no count says so below
            raise NpqwenError(f"params must be an npqwen.SamplingParams (or max_new_tokens, an integer), got "
                              f"{type(params).__name__} {str(params)[:40]!r}")
        if "max_new_tokens" in keywords:
            raise NpqwenError(f"max_new_tokens is given twice: {params!r} and "
                              f"max_new_tokens={keywords['max_new_tokens']!r}")
        keywords = {"max_new_tokens": params, **keywords}
    return SamplingParams(**keywords)


def sampling_params(defaults: dict, **values) -> SamplingParams:
    """SamplingParams(**values) with the checkpoint's `defaults` where a sampling value is None."""
    return SamplingParams(**values).with_defaults(defaults)


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
