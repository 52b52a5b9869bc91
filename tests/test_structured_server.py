"""Structured output through `npqwen serve` and the official openai client, on the tiny model's random
weights at temperature 1: .parse() with a pydantic model, json_object, json_schema streamed and not,
vLLM's structured_outputs, tool_choice required / named / auto with strict functions, the thinking
rule, and a 400 naming the field for every bad constraint, after which the server still answers."""
import json
import re
from typing import Annotated, Literal

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
from pydantic import BaseModel, Field  # noqa: E402

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402
from npqwen.server.constraints import tool_call_grammar  # noqa: E402
from npqwen.server.parsers import parse_output  # noqa: E402
from npqwen.server.protocol import Tool  # noqa: E402

from serving import LiveServer  # noqa: E402
from test_structured import ARITHMETIC, SCHEMAS, Boosted, arithmetic, valid_json  # noqa: E402

OFF = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server():
    """The tiny model with "</think>" and "<tool_call>" made likelier (random weights seldom write them)."""
    llm = npqwen.load("tiny")
    tokens = llm.tokenizer.token_to_id
    llm.model = Boosted(Boosted(llm.model, tokens("</think>"), 3.0), tokens("<tool_call>"), 2.0)
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=16384, page_size=16, max_batched_tokens=256))
    yield server
    server.close()


def chat(server, **kwargs):
    kwargs = {"model": "test-model", "messages": USER, "temperature": 1.0, "max_tokens": 400, **kwargs}
    return server.client().chat.completions.create(**kwargs)


def streamed(server, **kwargs) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) joined from a streamed chat."""
    reasoning = content = ""
    finish = None
    for chunk in chat(server, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def check_calls(tool_calls, names):
    for call in tool_calls:
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_parse_with_a_pydantic_model(server):
    client = server.client()
    for seed in range(3):
        out = client.chat.completions.parse(model="test-model", messages=USER, response_format=Person,
                                            temperature=1.0, seed=seed, max_tokens=400, extra_body=OFF)
        person = out.choices[0].message.parsed
        print(out.choices[0].message.content)
        assert isinstance(person, Person) and out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), Person.model_json_schema())


def test_json_object_and_json_schema_streamed_and_not(server):
    out = chat(server, response_format={"type": "json_object"}, seed=1, extra_body=OFF)
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    schema = SCHEMAS["$ref $defs"]
    for strict in (True, False, None):
        fmt = {"type": "json_schema", "json_schema": {"name": "points", "schema": schema,
                                                      **({} if strict is None else {"strict": strict})}}
        whole = chat(server, response_format=fmt, seed=2, extra_body=OFF)
        valid_json(whole.choices[0].message.content, schema)
        _, content, finish = streamed(server, response_format=fmt, seed=2, extra_body=OFF)
        assert content == whole.choices[0].message.content and finish == "stop"   # the pieces join to it
    two = chat(server, response_format=fmt, seed=3, n=2, extra_body=OFF)
    assert len(two.choices) == 2 and two.choices[0].message.content != two.choices[1].message.content
    for choice in two.choices:
        valid_json(choice.message.content, schema)


def test_the_responses_api_text_format(server):
    schema = SCHEMAS["nested objects"]
    fmt = {"format": {"type": "json_schema", "name": "user", "schema": schema, "strict": True}}
    client = server.client()
    r = client.responses.create(model="test-model", input="A user", text=fmt, temperature=1.0,
                                max_output_tokens=400, reasoning={"effort": "none"})
    assert r.status == "completed"
    valid_json(r.output_text, schema)
    with client.responses.stream(model="test-model", input="A user", text=fmt, temperature=1.0,
                                 max_output_tokens=400, reasoning={"effort": "none"}) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    valid_json(streamed, schema)
    # greedy: an object of free keys and strings, drawn at temperature 1 from the tiny model's random weights,
    # can still be inside a string after 400 tokens (the Responses API has no seed to pin a draw that ends)
    r = client.responses.create(model="test-model", input="Any object", text={"format": {"type": "json_object"}},
                                temperature=0, max_output_tokens=400, reasoning={"effort": "none"})
    assert isinstance(json.loads(r.output_text), dict)


def test_structured_outputs_on_chat_and_completions(server):
    client = server.client()
    regex = r"[a-z]{3,6} [0-9]{1,3}"
    out = chat(server, seed=4, extra_body={**OFF, "structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, out.choices[0].message.content)
    out = chat(server, seed=5, extra_body={**OFF, "structured_outputs": {"choice": ["left", "right"]}})
    assert out.choices[0].message.content in ("left", "right")
    done = client.completions.create(model="test-model", prompt="x =", max_tokens=200, temperature=1.0, seed=6,
                                     extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, done.choices[0].text)
    done = client.completions.create(model="test-model", prompt="x =", max_tokens=200, temperature=1.0, seed=7,
                                     extra_body={"structured_outputs": {"grammar": ARITHMETIC}})
    assert arithmetic(done.choices[0].text)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="test-model", prompt="{", max_tokens=300, temperature=1.0, seed=8, stream=True,
        extra_body={"structured_outputs": {"json": json.dumps(SCHEMAS["nested objects"])}}))
    valid_json(text, SCHEMAS["nested objects"])


def test_tool_choice_required_and_named(server):
    names = {"get_weather", "get_time"}
    for seed, thinking in ((0, False), (1, True)):
        extra = {} if thinking else OFF
        out = chat(server, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=seed,
                   extra_body=extra)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        check_calls(choice.message.tool_calls, names)
        if thinking:
            assert choice.message.reasoning_content is not None
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in (2, 3):
        out = chat(server, tools=[WEATHER, TIME], tool_choice=named, seed=seed, extra_body=OFF)
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        check_calls([call], {"get_time"})
    whole = chat(server, tools=[WEATHER, TIME], tool_choice=named, seed=2, extra_body=OFF).choices[0].message
    calls = {}
    for chunk in chat(server, tools=[WEATHER, TIME], tool_choice=named, seed=2, extra_body=OFF, stream=True):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (tc.function.name, tc.function.arguments) for tc in whole.tool_calls]


def test_auto_with_a_strict_function_constrains_each_call_the_model_opens(server):
    made = 0
    out = chat(server, tools=[WEATHER, TIME], seed=0, n=4, max_tokens=300, extra_body=OFF)   # seeds 0 .. 3
    for choice in out.choices:
        calls = choice.message.tool_calls or []
        check_calls([c for c in calls if c.function.name == "get_weather"], {"get_weather"})   # the strict one
        assert all(c.function.name in PARAMETERS for c in calls)
        made += len(calls)
    print(made, "calls")
    assert made > 0, "no tool call in four answers: raise the boost"


def test_the_lazy_tool_grammar_in_the_engine():
    """Every <tool_call> block the model opens in free text is a valid call (engine level, many seeds)."""
    llm = npqwen.load("tiny")
    llm.model = Boosted(llm.model, llm.tokenizer.token_to_id("<tool_call>"), 3.0)
    grammar = tool_call_grammar([Tool.model_validate(WEATHER), Tool.model_validate(TIME)], many=True, lazy=True)
    results = llm.generate(["a", "b", "c", "d", "e", "f"], grammar=grammar, temperature=1.0, seed=11,
                           max_new_tokens=300)
    closed = 0
    for r in results:
        blocks = re.findall(r"<tool_call>(.*?)</tool_call>", r.text, re.S)
        closed += len(blocks)
        parsed = parse_output(r.text, thinking=False).tool_calls
        assert len(parsed) == len(blocks), r.text      # every closed block parses as a call
        for call in parsed:
            if call["function"]["name"] == "get_weather":
                jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["get_weather"])
            else:
                assert call["function"]["name"] == "get_time"
    assert closed >= 3, [r.text for r in results]


def test_thinking_on_and_off(server):
    schema = SCHEMAS["nested objects"]
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}}
    reasoned = []
    for seed in range(3):
        on = chat(server, response_format=fmt, seed=seed).choices[0].message
        valid_json(on.content, schema)
        reasoned.append(on.reasoning_content or "")
        reasoning, content, _ = streamed(server, response_format=fmt, seed=seed)
        assert (reasoning, content) == (on.reasoning_content or "", on.content)
        off = chat(server, response_format=fmt, seed=seed, extra_body=OFF).choices[0].message
        assert getattr(off, "reasoning_content", None) is None
        valid_json(off.content, schema)
    assert any(reasoned)


BAD_CHAT = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format.json_schema.schema", "Invalid type"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema", "required"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "needs json_schema"),
    (dict(response_format={"type": "text", "json_schema": {"name": "x", "schema": {}}}),
     "response_format.json_schema", "only read with type"),
    (dict(extra_body={"structured_outputs": {"regex": "(a"}}), "structured_outputs.regex", "unclosed group"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs.choice", "non-empty list"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: nope"}}), "structured_outputs.grammar", "unknown"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "object", "not": {}}}}), "structured_outputs.json",
     "Unimplemented"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs",
     "not regex and choice"),
    (dict(extra_body={"structured_outputs": {"whitespace_pattern": " "}}),
     "structured_outputs.whitespace_pattern", "unsupported field"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
     "structured_outputs", "not both"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
          tool_choice="required"), "tools[0].function.parameters", "Invalid type"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "not both"),
]


def test_every_bad_constraint_is_a_400_naming_the_field_and_the_server_goes_on(server, capfd):
    client = server.client()
    for kwargs, param, message in BAD_CHAT:
        with pytest.raises(openai.BadRequestError) as info:
            chat(server, **kwargs)
        e = info.value
        assert (e.status_code, e.param) == (400, param) and message in e.message, (kwargs, e.body)
    for body, param in [({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
                        ({"response_format": {"type": "json_object"}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="test-model", prompt="x", extra_body=body)
        assert info.value.param == param, info.value.body
    out = chat(server, max_tokens=5, seed=0, extra_body={**OFF, "structured_outputs": {"choice": ["ok"]}})
    assert out.choices[0].message.content == "ok"
    server.wait_idle()
    assert not server.errors, [r.getMessage() for r in server.errors]
    assert "Traceback" not in capfd.readouterr().err


def test_a_constraint_that_fails_while_running_is_a_500_and_every_other_request_goes_on(server, monkeypatch, capfd):
    """llguidance failing on a running request (here its mask fill raises): that request gets a 500
    naming the constraint, streamed or not, and a free stream that was running beside it ends as usual."""
    import threading

    from npqwen.structured import Masks

    monkeypatch.setattr(Masks, "fill", lambda self, matchers: 1 / 0)
    free = {}

    def free_stream():
        free["answer"] = streamed(server, max_tokens=120, seed=3, extra_body={**OFF, "ignore_eos": True})
    thread = threading.Thread(target=free_stream)
    thread.start()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with pytest.raises(openai.InternalServerError) as info:
        chat(server, max_tokens=50, seed=1, extra_body=OFF,
             response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert info.value.status_code == 500 and "could not fill the json_schema constraint's" in info.value.message
    with pytest.raises(openai.APIError, match="could not fill the regex constraint's"):
        streamed(server, max_tokens=50, seed=2, extra_body={**OFF, "structured_outputs": {"regex": "[a-z]+!"}})
    text = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
    events = list(server.client().responses.create(model="test-model", input="JSON please", stream=True,
                                                   max_output_tokens=50, text=text, reasoning={"effort": "none"}))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"], [e.type for e in events]
    failed = events[-1].response
    assert failed.status == "failed" and "could not fill the json_schema constraint's" in failed.error.message
    thread.join(60)
    assert free["answer"][2] == "length" and free["answer"][1], free
    monkeypatch.undo()
    out = chat(server, max_tokens=5, seed=0, extra_body={**OFF, "structured_outputs": {"choice": ["ok"]}})
    assert out.choices[0].message.content == "ok"
    server.wait_idle()
    assert not server.errors, [r.getMessage() for r in server.errors]
    assert "Traceback" not in capfd.readouterr().err
