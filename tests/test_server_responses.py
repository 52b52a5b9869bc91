"""The Responses API (POST /v1/responses) through the openai client's responses.create and
responses.stream: text and message input, instructions, typed stream events, reasoning items,
function tools and their outputs, max_output_tokens, usage, and what it refuses."""
import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from serving import http_json, scripted_server  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = {   # the first trigger found in the prompt answers
    "SYS-BRIEF": "<think>\nBe brief, it says.\n</think>\n\nBrief.",
    "TOOLRESULT-17": "<think>\nThe tool says 17.\n</think>\n\nIt is 17 degrees in Paris.",
    "R-TOOL": "<think>\nI need the weather.\n</think>\n\n" + CALL,
    "R-NAMED": "<think>\n\n</think>\n\n" + CALL,   # tool_choice named: no thinking, the call's start in the prompt
    "R-THINK": "<think>\nTwo and two.\nThat is four.\n</think>\n\nThe answer is 4.",
    "R-LONG": "<think>\nA long line of reasoning that max_output_tokens cuts off.",
    "R-PLAIN": "<think>\n\n</think>\n\nNo reasoning here.",
}


@pytest.fixture(scope="module")
def server():
    yield from scripted_server(SCRIPT, kv_cache_tokens=8192)


def kinds(response) -> list[str]:
    return [item.type for item in response.output]


def test_text_input_reasoning_and_usage(server):
    client = server.client()
    r = client.responses.create(model="test-model", input="R-THINK")
    assert r.status == "completed" and r.incomplete_details is None and kinds(r) == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Two and two.\nThat is four." and r.output[0].summary == []
    assert r.output[1].content[0].text == "The answer is 4." == r.output_text and r.output[1].role == "assistant"
    assert r.id.startswith("resp_") and r.output[0].id.startswith("rs_") and r.output[1].id.startswith("msg_")
    ids = http_json("POST", server.url + "/tokenize", {"messages": [{"role": "user", "content": "R-THINK"}]})[1]
    answer = server.llm.tokenizer.encode(SCRIPT["R-THINK"])
    assert r.usage.input_tokens == ids["count"] and r.usage.output_tokens == len(answer) + 1   # and eos
    assert r.usage.output_tokens_details.reasoning_tokens == answer.index(server.llm.tokenizer.token_to_id(
        "</think>")) + 1
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_message_input_with_parts_and_instructions(server):
    client = server.client()
    r = client.responses.create(model="test-model", instructions="SYS-BRIEF", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "!"}]}])
    assert r.output_text == "Brief." and r.instructions == "SYS-BRIEF"
    # a developer message is the system message (Qwen3's template has no developer role: it would drop it)
    r = client.responses.create(model="test-model", input=[{"role": "developer", "content": "SYS-BRIEF"},
                                                           {"role": "user", "content": "Hello"}])
    assert r.output_text == "Brief.", r.output_text
    # reasoning effort none: Qwen3's thinking off (the empty think block is the template's)
    r = client.responses.create(model="test-model", input="R-PLAIN", reasoning={"effort": "none"})
    assert kinds(r) == ["message"] and r.output_text == "No reasoning here."


def test_function_tools_and_their_outputs(server):
    client = server.client()
    question = [{"role": "user", "content": "Weather in Paris? R-TOOL"}]
    r = client.responses.create(model="test-model", input=question, tools=[WEATHER])
    assert kinds(r) == ["reasoning", "function_call"], r.output
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    # the client sends the conversation back with the call's output (stateless: store false)
    conversation = question + [item.model_dump(exclude_none=True) for item in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "TOOLRESULT-17"}]
    r2 = client.responses.create(model="test-model", input=conversation, tools=[WEATHER], store=False)
    assert r2.output_text == "It is 17 degrees in Paris." and kinds(r2) == ["reasoning", "message"]
    # what the model read: the call and its result through the chat template
    text = server.llm.tokenizer.decode(http_json("POST", server.url + "/tokenize", {"messages": [
        {"role": "user", "content": "Weather in Paris? R-TOOL"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "TOOLRESULT-17"}]})[1]["tokens"])
    assert "<tool_response>\nTOOLRESULT-17\n</tool_response>" in text
    # tool_choice: a named function makes the answer start with the call
    r3 = client.responses.create(model="test-model", input="Weather? R-NAMED", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"})
    assert kinds(r3) == ["function_call"] and r3.tool_choice.name == "get_weather"


def test_stream_typed_events_join_to_the_whole_response(server):
    client = server.client()
    for question, tools in (("R-THINK", []), ("Weather? R-TOOL", [WEATHER])):
        whole = client.responses.create(model="test-model", input=question, tools=tools)
        with client.responses.stream(model="test-model", input=question, tools=tools) as stream:
            events = list(stream)
            final = stream.get_final_response()
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == \
            [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole.output]
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == whole.output[0].content[0].text
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == whole.output_text == final.output_text
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        done = [e.item.type for e in events if e.type == "response.output_item.done"]
        assert added == done == kinds(whole)
        assert final.usage.output_tokens == whole.usage.output_tokens
        if tools:
            (args,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
            assert json.loads(args) == {"city": "Paris"}


def test_max_output_tokens_makes_it_incomplete(server):
    client = server.client()
    r = client.responses.create(model="test-model", input="R-LONG", max_output_tokens=10)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert kinds(r) == ["reasoning"] and r.output[0].status == "incomplete" and r.usage.output_tokens == 10
    with client.responses.stream(model="test-model", input="R-LONG", max_output_tokens=10) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


@pytest.mark.parametrize("kwargs, param", [
    (dict(input="x", previous_response_id="resp_1"), "previous_response_id"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "strin"}}}),
     "text.format.schema"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (dict(input=[{"type": "web_search_call", "id": "ws_1"}]), "input[0].type"),
    (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input="x", background=True), "background"),
    (dict(input="x", include=["file_search_call.results"]), "include"),
    (dict(input="x", max_output_tokens=0), "max_output_tokens"),
    (dict(input="x", extra_body={"frequency_penalty": 1}), "frequency_penalty"),
    (dict(input=[{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]), "input[0].content[0]"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": 5}]), "input[0].output"),
    (dict(input=[{"role": "user", "content": [{"type": "input_text", "text": 3}]}]), "input[0].content[0]"),
])
def test_what_it_refuses(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().responses.create(model="test-model", **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_no_response_is_kept(server):
    status, answer = http_json("GET", server.url + "/v1/responses/resp_123")
    assert status == 404 and "keeps no responses" in answer["error"]["message"]


def test_nothing_above_made_the_server_log_an_error(server):
    assert not server.errors, [r.getMessage() for r in server.errors]
