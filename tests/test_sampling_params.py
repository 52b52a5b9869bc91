"""npqwen.SamplingParams: its checks, how the checkpoint's defaults fill it, and that passing it whole
runs exactly what today's keyword arguments run."""
import dataclasses
import re

import numpy as np
import pytest

import npqwen
from npqwen import Engine, NpqwenError, SamplingParams
from npqwen.structured import ConstraintError
from npqwen.tiny import TINY_GENERATION


@pytest.fixture(scope="module")
def tiny():
    return npqwen.load("tiny")


@pytest.mark.parametrize("bad, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    (dict(stop=5), "stop must be a string or a list of strings, got 5"),
    (dict(stop=["a", 1]), "stop must be a string or a list of strings"),
    (dict(temperature=-1), "temperature must be >= 0 (0 means greedy), got -1.0"),
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(top_p=0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_k=-1), "top_k must be an integer >= 0 (0 turns it off), got -1"),
    (dict(min_p=2), "min_p must be in [0, 1], got 2.0"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0 (1 turns it off), got 0.0"),
    (dict(presence_penalty="1"), "presence_penalty must be a finite number, got '1'"),
    (dict(seed=-3), "seed must be a non-negative integer, got -3"),
    (dict(logprobs=-1), "logprobs must be None or an integer >= 0 (alternatives per token), got -1"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs must be None or an integer >= 0"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
    (dict(regex="a+", choice=["a"]), "give one constraint, not regex and choice"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
])
def test_every_value_is_checked_when_made(bad, message):
    with pytest.raises(NpqwenError, match=re.escape(message)) as e:
        SamplingParams(**bad)
    assert "\n" not in str(e.value)


def test_a_constraint_error_stays_a_constraint_error():   # the server answers it 400 with the body's field
    with pytest.raises(ConstraintError):
        SamplingParams(choice=["yes", 2])


def test_values_are_stored_plainly_and_frozen():
    p = SamplingParams(max_new_tokens=np.int64(7), temperature=np.float32(0.5), top_k=np.int32(3), seed=np.uint8(2),
                       stop="END", choice=["a", "b"], logprobs=np.int64(2), thinking=1)
    assert (p.max_new_tokens, p.temperature, p.top_k, p.seed, p.logprobs) == (7, 0.5, 3, 2, 2)
    assert type(p.max_new_tokens) is int and type(p.temperature) is float and type(p.top_k) is int
    assert p.stop == ("END",) and p.choice == ("a", "b") and p.thinking is True
    assert p.constraint[0] == "choice" and SamplingParams().constraint is None
    assert SamplingParams(stop=["a"]) == SamplingParams(stop=("a",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    with pytest.raises(TypeError):   # by name only
        SamplingParams(0.7)


def test_checkpoint_defaults_fill_what_is_not_set():
    defaults = dict(TINY_GENERATION)   # temperature 0.6, top_k 20, top_p 0.95, and eos ids
    unset = SamplingParams()
    assert unset.temperature is None and unset.greedy   # not set, and nothing to fill it: greedy
    filled = unset.with_defaults(defaults)
    assert (filled.temperature, filled.top_k, filled.top_p, filled.min_p) == (0.6, 20, 0.95, None)
    mine = SamplingParams(temperature=0, top_k=0, max_new_tokens=5).with_defaults(defaults)
    assert (mine.temperature, mine.top_k, mine.top_p, mine.max_new_tokens) == (0.0, 0, 0.95, 5)   # given values win
    assert mine.greedy
    assert SamplingParams(temperature=0.1, top_k=1, top_p=0.5).with_defaults(defaults) == \
        SamplingParams(temperature=0.1, top_k=1, top_p=0.5)
    assert unset.with_defaults({}) is unset


def test_the_engine_applies_the_checkpoint_defaults(tiny):
    engine = Engine(tiny, kv_cache_tokens=1024, page_size=16)
    req = engine.new_request("Hi", SamplingParams(max_new_tokens=3))
    assert (req.params.temperature, req.params.top_k, req.params.top_p) == (0.6, 20, 0.95)
    assert req.max_new_tokens == 3 and not engine.has_unfinished()   # made, not queued


def sampled(engine, how):
    """The tokens of one request added as `how` says, run to the end."""
    rid = how(engine)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
    return tokens


@pytest.mark.parametrize("values", [dict(max_new_tokens=12, temperature=1.0, seed=3),
                                    dict(max_new_tokens=12, seed=4),   # the checkpoint's sampling values
                                    dict(max_new_tokens=10, temperature=0.8, top_k=5, top_p=0.9, min_p=0.01,
                                         repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                                         seed=5, stop=["x"]),
                                    dict(max_new_tokens=8, temperature=1.0, seed=6, choice=["alpha", "beta"])])
def test_params_whole_equal_keyword_arguments_token_for_token(tiny, values):
    def engine():
        return Engine(tiny, kv_cache_tokens=1024, page_size=16)
    keywords = sampled(engine(), lambda e: e.add_request("Once upon a time", **values))
    whole = sampled(engine(), lambda e: e.add_request("Once upon a time", SamplingParams(**values)))
    rest = {k: v for k, v in values.items() if k != "max_new_tokens"}
    positional = sampled(engine(), lambda e: e.add_request("Once upon a time", values["max_new_tokens"], **rest))
    assert keywords == whole == positional and len(keywords) > 0
    params = SamplingParams(**values)
    assert tiny.generate("Once upon a time", params).token_ids == tiny.generate("Once upon a time", **values).token_ids
    assert "".join(tiny.stream("Once upon a time", params=params)) == tiny.generate("Once upon a time", params).text


def test_chat_takes_params_and_sets_thinking_from_enable_thinking(tiny):
    params = SamplingParams(max_new_tokens=6, temperature=0)
    assert tiny.chat("Hi", params=params).token_ids == tiny.chat("Hi", max_new_tokens=6, temperature=0).token_ids
    off = tiny.chat("Hi", enable_thinking=False, params=params)
    assert off.token_ids == tiny.generate(tiny.chat_prompt("Hi", enable_thinking=False), params).token_ids


def test_params_and_keyword_arguments_do_not_mix(tiny):
    engine = Engine(tiny, kv_cache_tokens=1024, page_size=16)
    message = "give the sampling values as params or as keyword arguments, not both: got params and temperature, seed"
    with pytest.raises(NpqwenError, match=re.escape(message)):
        engine.add_request("Hi", SamplingParams(), temperature=1.0, seed=2)
    with pytest.raises(NpqwenError, match="not both"):
        tiny.generate("Hi", params=SamplingParams(), max_new_tokens=3)
    with pytest.raises(NpqwenError, match="max_new_tokens is given twice"):
        engine.add_request("Hi", 4, max_new_tokens=5)
    with pytest.raises(NpqwenError, match="params must be an npqwen.SamplingParams"):
        tiny.generate("Hi", {"temperature": 0})
    with pytest.raises(NpqwenError, match="temprature"):   # a misspelt value is not ignored
        tiny.generate("Hi", temprature=0)
    assert not engine.has_unfinished() and not tiny.engine.has_unfinished()


def test_a_mistyped_keyword_names_the_function_called_and_the_nearest_option(tiny):
    """Before: every call said "SamplingParams.__init__() got an unexpected keyword argument", a TypeError."""
    engine = Engine(tiny, kv_cache_tokens=1024, page_size=16)
    for call, name in ((tiny.generate, "LLM.generate"), (tiny.stream, "LLM.stream"), (tiny.chat, "LLM.chat"),
                       (engine.add_request, "Engine.add_request")):
        with pytest.raises(NpqwenError, match=re.escape(f"{name}() got an unexpected keyword argument 'tempreature'; "
                                                        f"did you mean temperature?")):
            call("hi", tempreature=0)
    with pytest.raises(NpqwenError, match=re.escape("'steerin'; did you mean steering?")):   # its own parameters too
        tiny.generate("hi", steerin=None)
    with pytest.raises(NpqwenError, match=r"'zzz' \(the sampling values: max_new_tokens, stop, temperature"):
        tiny.generate("hi", zzz=1)
    assert not engine.has_unfinished()


def test_an_empty_stop_string_is_refused_as_vllm_does():
    for stop in ("", ["\n", ""]):
        with pytest.raises(NpqwenError, match="stop cannot contain an empty string"):
            SamplingParams(stop=stop)
