"""Structured output in the engine and the Python API: on random weights at temperature 1 (only the
mask keeps the text valid) every answer parses and validates (jsonschema), fully matches its regex,
is one of its choices, or parses by its grammar; constrained and free requests share steps; a
preempted one is recomputed; a seed draws the same whatever the company; the thinking rule; bad
constraints are refused at once."""
import ast
import json
import re
import sys
import threading
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import npqwen  # noqa: E402
from npqwen import Engine, NpqwenError  # noqa: E402
from npqwen.backend import to_numpy  # noqa: E402
from npqwen.structured import Masks  # noqa: E402

from conftest import needs_qwen3_tokenizer  # noqa: E402

FORMATS = jsonschema.FormatChecker()   # date, date-time, email, uuid, ... are checked too


def obj(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required}


DIGIT = {"type": "integer", "minimum": -9, "maximum": 9}
SCHEMAS = {   # each keeps its answers short (bounded strings and arrays), so they end well within max_tokens
    "nested objects": obj({"user": obj({"name": {"type": "string", "maxLength": 6},
                                        "id": {"type": "integer", "minimum": 1, "maximum": 999}})}),
    "array minItems maxItems": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                "minItems": 2, "maxItems": 4},
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 4},
                        {"type": "null"}]},
    "$ref $defs": {"$defs": {"point": obj({"x": DIGIT, "y": DIGIT})},
                   **obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})},
    "integer range": {"type": "integer", "minimum": -50, "maximum": 50},
    "number range": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "exclusive range": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "string lengths": {"type": "string", "minLength": 3, "maxLength": 8},
    "format date": {"type": "string", "format": "date"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email", "maxLength": 24},
    "format uuid": {"type": "string", "format": "uuid"},
    "optional field": obj({"id": {"type": "integer", "minimum": 0, "maximum": 9},
                           "note": {"type": "string", "maxLength": 5}}, required=["id"]),
    "boolean const": obj({"ok": {"type": "boolean"}, "v": {"const": 3}}),
    "array of objects": {"type": "array", "items": obj({"k": {"enum": ["a", "b"]}, "n": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 3}}),
                         "minItems": 1, "maxItems": 3},
    "type list": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, 2]}], "items": False},
}
SEEDS = (0, 1, 2)
ARITHMETIC = """start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]?/
"""
ARITHMETIC_GBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [1-9] [0-9]? | "(" expr ")"
"""


@pytest.fixture(scope="module")
def tiny():
    return npqwen.load("tiny")


def run(engine, requests, on_step=None) -> list:
    """Add every (prompt, kwargs), step to the end checking the bookkeeping (pages and matchers) after
    every step; the GenerationResults in order."""
    ids = [engine.add_request(prompt, **kwargs) for prompt, kwargs in requests]
    results, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.result
        engine.check()
        steps += 1
        if on_step is not None:
            on_step(engine)
        assert steps < 5000
    return [results[i] for i in ids]


def valid_json(text: str, schema: dict):
    """The parsed answer; fails with the answer and what jsonschema says when it does not validate."""
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=FORMATS)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        pytest.fail(f"{text!r} is not valid: {e}")
    return value


def arithmetic(text: str) -> bool:
    """The text is an expression of 1-2 digit numbers, + and - and parentheses (Python parses it)."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Constant)
    return all(isinstance(n, allowed) for n in ast.walk(tree)) and re.fullmatch(r"[0-9+\-()]+", text) is not None


class Boosted:
    """The tiny model with one token's logit raised: random weights rarely write "</think>" or
    "<tool_call>", which the thinking and tool tests need them to."""

    def __init__(self, model, token: int, boost: float):
        self.model, self.token, self.boost = model, token, boost

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_batch(self, batch, kv, recorder=None):
        out = self.model.forward_batch(batch, kv, recorder)
        logits = to_numpy(out.logits).copy()
        logits[:, self.token] += self.boost
        return out._replace(logits=logits)


# -- JSON schemas, regex, choice, grammar on random weights --

def test_every_schema_holds_on_random_weights_at_temperature_1(tiny):
    engine = Engine(tiny, kv_cache_tokens=64 * 1024, page_size=16, max_batched_tokens=512)
    requests = [("JSON:", dict(max_new_tokens=400, temperature=1.0, seed=seed, json_schema=schema))
                for schema in SCHEMAS.values() for seed in SEEDS]
    results = iter(run(engine, requests))
    for name, schema in SCHEMAS.items():
        answers = []   # texts
        for seed in SEEDS:
            r = next(results)
            print(f"{name} seed {seed}: {r.finish_reason} {len(r.token_ids)} tokens {r.text!r}")
            # stop: the matcher was complete (no eos drawn), or accepted eos where the answer could go on ("7")
            assert r.finish_reason == "stop" and (r.stop is None or r.token_ids[-1] in tiny.eos_token_ids)
            valid_json(r.text, schema)
            answers.append(r.text)
        # drawn, not fixed (compact JSON leaves "boolean const" two answers, which three seeds may not both draw)
        assert len(set(answers)) > 1 or name == "boolean const", (name, answers)
    free = tiny.generate("JSON:", max_new_tokens=40, temperature=1.0, seed=0)
    with pytest.raises(json.JSONDecodeError):   # what the weights say without the mask
        json.loads(free.text)


def test_schema_as_json_text_through_a_list_of_prompts(tiny):
    schema = SCHEMAS["nested objects"]
    results = tiny.generate(["a", "bb", "ccc"], json_schema=json.dumps(schema), temperature=1.0, seed=5,
                            max_new_tokens=300)
    for r in results:
        assert r.finish_reason == "stop"
        valid_json(r.text, schema)


def test_regex_choice_and_grammars(tiny):
    engine = Engine(tiny, kv_cache_tokens=32 * 1024, page_size=16)
    cities = ["Paris", "Lyon", "Marseille", "Lille"]
    cases = [("regex", r"[a-z]{2,5}-[0-9]{1,3}", lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", t)),
             ("regex", r"(yes|no), because [a-z ]{1,12}\.",
              lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,12}\.", t)),
             ("choice", cities, lambda t: t in cities),
             ("grammar", ARITHMETIC, arithmetic),      # the same language in Lark ...
             ("grammar", ARITHMETIC_GBNF, arithmetic)]  # ... and in GBNF
    requests = [("Answer:", dict(max_new_tokens=200, temperature=1.0, seed=seed, **{kind: value}))
                for kind, value, _ in cases for seed in range(4)]
    results = iter(run(engine, requests))
    for kind, value, check in cases:
        texts = [next(results).text for _ in range(4)]
        print(kind, texts)
        assert all(check(t) for t in texts), (kind, value, texts)


def test_a_complete_answer_ends_without_eos_an_open_one_with_it(tiny):
    r = tiny.generate("Pick:", choice=["yes", "no"], temperature=1.0, seed=3)
    assert r.text in ("yes", "no") and r.finish_reason == "stop" and r.stop is None
    assert tiny.tokenizer.decode(r.token_ids) == r.text                # no eos token drawn
    # [0-9]+ may go on or end: the mask allows eos too, and the model drew it (not in the text)
    results = tiny.generate(["1", "2", "3", "4"], regex="[0-9]+", temperature=1.0, seed=1, max_new_tokens=100)
    assert all(re.fullmatch("[0-9]+", r.text) for r in results)
    ended = [r for r in results if r.finish_reason == "stop"]
    assert ended and all(r.token_ids[-1] in tiny.eos_token_ids and r.stop for r in ended)


def test_min_tokens_and_a_constraint(tiny):
    """vLLM's min_tokens keeps eos away while the constraint allows more: [0-9]{1,3} gets 3 digits."""
    engine = Engine(tiny, kv_cache_tokens=4096, page_size=16)
    ids = [engine.add_request("n:", regex="[0-9]{1,3}", temperature=1.0, seed=s) for s in range(6)]
    for rid in ids:
        engine.requests[rid].min_tokens = 3
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o.result for o in engine.step() if o.finished})
    assert all(re.fullmatch("[0-9]{3}", results[rid].text) and results[rid].stop is None for rid in ids)


def test_max_tokens_cuts_the_answer(tiny):
    r = tiny.generate("JSON:", json_schema=SCHEMAS["nested objects"], max_new_tokens=4, temperature=1.0, seed=0)
    assert r.finish_reason == "length" and len(r.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)


# -- in the engine: batches, preemption, seeds, the overlap --

def test_constrained_and_free_share_a_step_and_neither_disturbs_the_other(tiny):
    free = [("Once upon", dict(max_new_tokens=30, temperature=1.0, seed=7)),
            ("Hello", dict(max_new_tokens=30, temperature=0.8, top_k=40, seed=8))]
    constrained = [("JSON:", dict(max_new_tokens=300, temperature=1.0, seed=9, json_schema=SCHEMAS["$ref $defs"])),
                   ("Say:", dict(max_new_tokens=100, temperature=0.7, top_p=0.9, seed=10, regex="[A-Z][a-z]{2,9}!"))]
    sizes = []
    together = run(Engine(tiny, kv_cache_tokens=8192, page_size=16), free[:1] + constrained + free[1:],
                   on_step=lambda e: sizes.append(len(e.scheduler.running)))
    assert max(sizes) == 4                               # all four were in one step
    alone = [run(Engine(tiny, kv_cache_tokens=8192, page_size=16), [r])[0] for r in free[:1] + constrained + free[1:]]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids, (a.text, b.text)   # same seed, other company: the same tokens
    valid_json(together[1].text, SCHEMAS["$ref $defs"])
    assert re.fullmatch("[A-Z][a-z]{2,9}!", together[2].text)


def test_preempted_constrained_requests_are_recomputed_and_match(tiny):
    P = 16
    requests = [("JSON " * 6, dict(max_new_tokens=100, temperature=1.0, seed=s, json_schema=SCHEMAS["$ref $defs"]))
                for s in range(4)]
    roomy = run(Engine(tiny, kv_cache_tokens=64 * P, page_size=P), requests)
    tight = Engine(tiny, kv_cache_tokens=12 * P, page_size=P)   # each fits alone (<= 9 pages), not all four
    squeezed = run(tight, requests)                              # run checks the matchers after every step
    print("preemptions:", tight.stats["preemptions"], [len(r.token_ids) for r in roomy])
    assert tight.stats["preemptions"] > 0
    assert [r.token_ids for r in squeezed] == [r.token_ids for r in roomy]
    for r in squeezed:
        valid_json(r.text, SCHEMAS["$ref $defs"])
    # a prefix-cache hit: the same prompt again reuses pages and draws the same answer
    again = run(tight, requests[:1])
    assert tight.stats["prefix_cache_hit_tokens"] > 0 and again[0].token_ids == roomy[0].token_ids


def test_the_masks_are_filled_while_the_forward_pass_runs(tiny, monkeypatch):
    times = {}
    fill = Masks.fill

    def timed_fill(self, matchers):
        times.setdefault("fill", []).append((time.perf_counter(), threading.current_thread().name))
        return fill(self, matchers)

    class Slow(Boosted):
        def forward_batch(self, batch, kv, recorder=None):
            start = time.perf_counter()
            time.sleep(0.05)
            times.setdefault("forward", []).append((start, time.perf_counter()))
            return self.model.forward_batch(batch, kv, recorder)

    monkeypatch.setattr(Masks, "fill", timed_fill)
    engine = Engine(tiny, kv_cache_tokens=4096, page_size=16)
    engine.model = Slow(tiny.model, 0, 0.0)
    rid = engine.add_request("Pick:", choice=["alpha", "beta"], temperature=1.0, seed=0)
    while rid in engine.requests:
        engine.step()
    assert len(times["fill"]) == len(times["forward"]) >= 4
    for (fill_start, thread), (forward_start, forward_end) in zip(times["fill"], times["forward"]):
        assert thread.startswith("npqwen-masks") and fill_start < forward_end   # begun before the pass ended


@pytest.mark.parametrize("failure", ["matcher", "fill"])
def test_a_constraint_that_fails_while_running_ends_only_its_own_request(tiny, monkeypatch, failure):
    """llguidance failing mid-answer (its matcher in error: it would allow only end-of-sequence, an
    invalid answer; or the mask fill raising): that request ends with finish_reason "error" and the
    message, the free request beside it draws what it draws alone, and LLM.generate raises it."""
    requests = [("Once upon", dict(max_new_tokens=30, temperature=1.0, seed=7)),
                ("JSON:", dict(max_new_tokens=300, temperature=1.0, seed=9, json_schema=SCHEMAS["$ref $defs"]))]
    alone = run(Engine(tiny, kv_cache_tokens=8192, page_size=16), requests[:1])[0]
    engine = Engine(tiny, kv_cache_tokens=8192, page_size=16)
    steps = []

    def break_llguidance(engine):
        steps.append(engine)
        if len(steps) == 4 and failure == "matcher":   # it takes a token no JSON answer can have
            constraint = next(r.constraint for r in engine.requests.values() if r.constraint is not None)
            constraint.matcher.consume_token(5)
            assert constraint.matcher.is_error()
            constraint.consumed += 1   # what the engine's bookkeeping expects of a taken token
        if len(steps) == 4 and failure == "fill":
            monkeypatch.setattr(Masks, "fill", lambda self, matchers: 1 / 0)
    free, failed = run(engine, requests, on_step=break_llguidance)
    assert free.token_ids == alone.token_ids, (free.text, alone.text)
    assert failed.finish_reason == "error" and len(failed.token_ids) >= 3, failed
    print("error:", failed.error)
    assert ("json_schema constraint failed" in failed.error if failure == "matcher"
            else "could not fill the json_schema constraint's next-token mask: division by zero" in failed.error)
    assert not engine.requests and not engine.scheduler.running   # run() checked the pages after every step
    if failure == "fill":
        with pytest.raises(npqwen.NpqwenError, match="could not fill"):
            tiny.generate("JSON:", max_new_tokens=20, json_schema=SCHEMAS["$ref $defs"])
        monkeypatch.undo()
        assert tiny.generate("JSON:", max_new_tokens=5, temperature=0).finish_reason == "length"   # it goes on


# -- the thinking rule --

def test_chat_thinking_on_reasons_freely_then_constrains_off_from_the_first_token(tiny):
    llm = npqwen.load("tiny")
    think_end = llm.tokenizer.token_to_id("</think>")
    llm.model = Boosted(llm.model, think_end, 3.0)
    schema = SCHEMAS["nested objects"]
    reasoned = []
    for seed in range(4):
        on = llm.chat("JSON please", json_schema=schema, temperature=1.0, seed=seed, max_new_tokens=400)
        assert on.finish_reason == "stop" and on.token_ids.count(think_end) == 1, on.text
        assert on.text.startswith("<think>")             # as Qwen3 opens it, so the parsers read reasoning
        valid_json(on.content, schema)
        reasoned.append(on.reasoning)
        off = llm.chat("JSON please", enable_thinking=False, json_schema=schema, temperature=1.0, seed=seed,
                       max_new_tokens=400)
        assert off.finish_reason == "stop" and off.reasoning == "" and think_end not in off.token_ids
        valid_json(off.text, schema)                     # the very first token is the constraint's
    print("reasoning:", reasoned)
    assert any(r.strip() for r in reasoned)              # free text before </think>
    with pytest.raises(json.JSONDecodeError):
        json.loads("".join(reasoned))


def test_while_reasoning_the_answer_cannot_end(tiny):
    """Only eos is taken away before "</think>": with it boosted too, the reasoning still runs to "</think>"."""
    llm = npqwen.load("tiny")
    eos, think_end = llm.eos_token_ids[0], llm.tokenizer.token_to_id("</think>")
    llm.model = Boosted(Boosted(llm.model, eos, 4.0), think_end, 2.5)
    plain = llm.chat("Hi", temperature=1.0, seed=0, max_new_tokens=200)
    assert plain.token_ids[-1] == eos and think_end not in plain.token_ids   # free: eos comes first
    r = llm.chat("Hi", regex="(yes|no)", temperature=1.0, seed=0, max_new_tokens=400)
    assert think_end in r.token_ids and r.content in ("yes", "no"), r.text


def test_a_prompt_that_opened_or_closed_the_reasoning():
    llm = npqwen.load("tiny")
    think_open, think_end = (llm.tokenizer.token_to_id(t) for t in ("<think>", "</think>"))
    llm.model = Boosted(llm.model, think_end, 3.0)
    engine = Engine(llm, kv_cache_tokens=4096, page_size=16)
    opened, closed = (engine.add_request(prompt, max_new_tokens=300, choice=["a1", "b2"], thinking=True,
                                         temperature=1.0, seed=1)
                      for prompt in ("Q<think>\n", "Q<think>\nok\n</think>\n\n"))
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o.result for o in engine.step() if o.finished})
    assert results[opened].token_ids[0] != think_open and think_end in results[opened].token_ids
    assert results[opened].text.split("</think>")[1].lstrip("\n") in ("a1", "b2")
    closed_text = results[closed].text
    assert closed_text.lstrip("\n") in ("a1", "b2") and think_end not in results[closed].token_ids   # at once


# -- bad constraints --

@pytest.mark.parametrize("kwargs, message", [
    (dict(json_schema={"type": "object"}, regex="a+"), "give one constraint, not json_schema and regex"),
    (dict(json_schema=[1, 2]), "json_schema must be a JSON Schema"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema={"type": "strin"}), "Invalid type: strin"),
    (dict(json_schema={"not": {"type": "string"}}), "Unimplemented keys"),
    (dict(json_schema={"type": "string", "format": "ipv9"}), "Unknown format: ipv9"),
    (dict(json_schema={"$ref": "#/$defs/missing"}), "does not exist"),
    (dict(json_schema={"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable"),
    (dict(regex="(unclosed"), "unclosed group"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(regex=42), "regex must be a non-empty string"),
    (dict(choice=[]), "choice must be a non-empty list of strings"),
    (dict(choice="yes"), "choice must be a non-empty list of strings"),
    (dict(choice=["yes", 2]), r"choice\[1\] must be a non-empty string"),
    (dict(grammar="start: undefined_rule"), "unknown name"),
    (dict(grammar='root ::= "a'), "neither llguidance.s Lark nor GBNF"),
])
def test_bad_constraints_are_refused_at_once(tiny, kwargs, message):
    engine = Engine(tiny, kv_cache_tokens=1024, page_size=16)
    with pytest.raises(NpqwenError, match=message):
        engine.add_request("x", **kwargs)
    with pytest.raises(NpqwenError, match=message):
        tiny.generate("x", **kwargs)
    assert not engine.has_unfinished() and not tiny.engine.has_unfinished()


def test_without_llguidance_a_constraint_names_the_extra(tiny, monkeypatch):
    want = tiny.generate("x", max_new_tokens=2, temperature=0)
    monkeypatch.setitem(sys.modules, "llguidance", None)   # import llguidance now raises ImportError
    with pytest.raises(NpqwenError, match=re.escape("pip install 'npqwen[structured]'")):
        Engine(tiny, kv_cache_tokens=1024, page_size=16).add_request("x", regex="a+")
    got = tiny.generate("x", max_new_tokens=2, temperature=0)   # the rest works without it, as with it
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (got, want)


# -- the exact Qwen3-0.6B shape with the real tokenizer (151,936 tokens) --

def test_qwen3_0_6b_shape_with_the_real_tokenizer(qwen3_0_6b_shape):
    needs_qwen3_tokenizer()
    llm = npqwen.load(qwen3_0_6b_shape)
    schemas = [SCHEMAS["nested objects"], SCHEMAS["format uuid"], SCHEMAS["array of objects"]]
    requests = [("Answer in JSON:", dict(max_new_tokens=120, temperature=1.0, seed=s, json_schema=schema))
                for s, schema in enumerate(schemas)]
    requests += [("Answer:", dict(max_new_tokens=30, temperature=1.0, seed=2, regex=r"[A-Z][a-z]{1,6} [0-9]{2}")),
                 ("Answer:", dict(max_new_tokens=30, temperature=1.0, seed=3, choice=["Paris", "Lyon"]))]
    started = time.perf_counter()
    results = run(Engine(llm, kv_cache_tokens=4096, page_size=64), requests)
    print(f"{sum(len(r.token_ids) for r in results)} tokens in {time.perf_counter() - started:.1f} s")
    for (_, kwargs), r in zip(requests, results):
        print(repr(r.text))
        assert r.finish_reason == "stop", r.text
        if "json_schema" in kwargs:
            valid_json(r.text, kwargs["json_schema"])
    assert re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", results[-2].text) and results[-1].text in ("Paris", "Lyon")
    assert max(max(r.token_ids) for r in results) >= 256   # real multi-byte tokens, not bytes one at a time


def test_bench_structured_suite_reports_every_figure(tmp_path, tiny):
    """The bench's structured suite on the tiny model (with its tokenizer): every figure; no time asserted."""
    import subprocess

    from conftest import ROOT

    model = tiny.save(tmp_path / "tiny")
    cmd = [sys.executable, "-m", "tools.bench", "--model", str(model), "--engines", "npqwen", "--threads", "1",
           "--suites", "structured", "--structured-batch", "3", "--structured-steps", "2", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    figures = report["engines"]["npqwen"]
    assert set(figures["structured_masks"]) == {"small", "medium", "large"}
    for name, m in figures["structured_masks"].items():
        assert m["tokens"] > 10 and m["fill_mean_ms"] > 0 and m["fill_p99_ms"] >= m["fill_mean_ms"] * 0.5, name
    assert figures["structured_step_free_s"] > 0 and figures["structured_step_constrained_s"] > 0
    assert "structured_step_overhead_pct" in report["figures"]


def test_undeclared_keys_only_where_the_schema_allows_them(tiny):
    """A schema that declares its properties and says nothing of others: the answer holds none but
    them (before: random weights wrote keys of their own, often until max_tokens), as vLLM's default
    grammar backend does; "additionalProperties": true, or a schema, still lets the model add keys."""
    from npqwen.structured import new_constraint

    declared = {"type": "object", "properties": {"a": DIGIT, "b": {"type": "object", "properties": {"c": DIGIT}}}}
    engine = Engine(tiny, kv_cache_tokens=64 * 1024, page_size=16, max_batched_tokens=512)
    results = run(engine, [("JSON:", dict(max_new_tokens=200, temperature=1.0, seed=seed, json_schema=declared))
                           for seed in range(6)])
    for r in results:
        print(r.finish_reason, repr(r.text))
        value = valid_json(r.text, declared)
        assert r.finish_reason == "stop" and set(value) <= {"a", "b"} and set(value.get("b", {})) <= {"c"}, r.text

    def takes(schema, text: str) -> bool:   # does the matcher take text's tokens as (the start of) an answer?
        constraint = new_constraint(tiny.tokenizer, tiny.config.vocab_size, tiny.eos_token_ids, json_schema=schema)
        return all(constraint.matcher.consume_token(t) for t in tiny.tokenizer.encode(text))
    assert not takes(declared, '{"z": 1}') and not takes(declared, '{"b": {"z": 1}}')
    assert takes(declared, '{"a": 1, "b": {"c": 2}}')
    assert takes({**declared, "additionalProperties": True}, '{"z": 1}')
    assert takes({**declared, "additionalProperties": {"type": "integer"}}, '{"z": 1}')
    assert takes({"type": "object"}, '{"z": 1}')   # no properties declared: any object
