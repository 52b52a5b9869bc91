"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
anthropic SDK: messages.create and messages.stream, thinking enabled / adaptive / disabled, a forced
tool call and its tool_result, output_config.format, count_tokens, the prefix cache's reads, each
error as the SDK's exception class, and a request in the shape Claude Code sends."""
import asyncio
import json
import urllib.request

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")

import jsonschema  # noqa: E402

from npqwen.server.protocol import APIError  # noqa: E402
from npqwen.server.protocol_messages import MessagesRequest, anthropic_error  # noqa: E402
from npqwen.server.serving_messages import pinging, to_chat_request  # noqa: E402

from serving import LiveServer, ScriptedModel, http_json, tiny_server  # noqa: E402,F401

MODEL = "test-model"
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NO_THINK = "<think>\n\n</think>\n\n"   # what the template writes when thinking is off
SCRIPT = {   # the first trigger found in the prompt answers
    "TOOLRESULT-17": NO_THINK + "It is 17 degrees in Paris.",
    "M-TOOL": NO_THINK + CALL,
    "M-JSON": NO_THINK + '{"answer": 4}',
    "M-THINK": "<think>\nTwo and two.\nThat is four.\n</think>\n\nThe answer is 4.",
    "M-STOP": NO_THINK + "one two three END four",
    "M-CODE": NO_THINK + "I will read the file.",
    "M-PLAIN": NO_THINK + "No reasoning here.",
}


@pytest.fixture(scope="module")
def server():
    """The tiny model answering by SCRIPT, with --api-key k."""
    import npqwen
    from npqwen import Engine

    llm = npqwen.load("tiny")
    llm.model = ScriptedModel(llm.model, llm.tokenizer, SCRIPT, eos_id=llm.eos_token_ids[0])
    live = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=8192, page_size=16, prefix_cache=False), api_key="k")
    yield live
    live.close()


def client(server, **kwargs) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key=kwargs.pop("api_key", "k"), max_retries=0, timeout=60,
                               **kwargs)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_text_usage_and_count_tokens(server):
    c = client(server)
    m = c.messages.create(model=MODEL, max_tokens=64, messages=ask("M-PLAIN"))
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "No reasoning here."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    answer = server.llm.tokenizer.encode("No reasoning here.")
    assert m.usage.output_tokens == len(answer) + 1   # and eos
    assert m.usage.cache_read_input_tokens == 0 and m.usage.cache_creation_input_tokens == 0
    count = c.messages.count_tokens(model=MODEL, messages=ask("M-PLAIN"))
    assert count.input_tokens == m.usage.input_tokens > 0
    # the system prompt as a string or as text blocks: the same prompt
    system = [{"type": "text", "text": "You are brief."}, {"type": "text", "text": "Really.",
                                                             "cache_control": {"type": "ephemeral"}}]
    one = c.messages.count_tokens(model=MODEL, messages=ask("M-PLAIN"), system="You are brief.\n\nReally.")
    assert c.messages.count_tokens(model=MODEL, messages=ask("M-PLAIN"), system=system).input_tokens == \
        one.input_tokens > count.input_tokens


def test_thinking_enabled_adaptive_and_disabled(server):
    c = client(server)
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        m = c.messages.create(model=MODEL, max_tokens=2048, messages=ask("M-THINK"), thinking=thinking)
        assert [b.type for b in m.content] == ["thinking", "text"], thinking
        assert m.content[0].thinking == "Two and two.\nThat is four." and m.content[1].text == "The answer is 4."
    for thinking in ({"type": "disabled"}, None):   # off, as Anthropic's default: the template's empty think block
        kwargs = {"thinking": thinking} if thinking else {}
        m = c.messages.create(model=MODEL, max_tokens=64, messages=ask("M-PLAIN"), **kwargs)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == "No reasoning here."
    on = c.messages.count_tokens(model=MODEL, messages=ask("x"), thinking={"type": "adaptive"}).input_tokens
    off = c.messages.count_tokens(model=MODEL, messages=ask("x"), thinking={"type": "disabled"}).input_tokens
    assert off == on + len(server.llm.tokenizer.encode(NO_THINK))


def test_stream_events_and_final_message_equal_create(server):
    c = client(server)
    for kwargs in (dict(messages=ask("M-THINK"), thinking={"type": "adaptive"}),
                   dict(messages=ask("Weather? M-TOOL"), tools=[WEATHER])):
        whole = c.messages.create(model=MODEL, max_tokens=256, **kwargs)
        with c.messages.stream(model=MODEL, max_tokens=256, **kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
        types = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                       "message_delta", "message_stop")]
        n = len(whole.content)
        assert types == ["message_start"] + ["content_block_start", "content_block_stop"] * n + \
            ["message_delta", "message_stop"], types
        assert [b.model_dump(exclude={"id"}) for b in final.content] == \
            [b.model_dump(exclude={"id"}) for b in whole.content]
        assert final.stop_reason == whole.stop_reason and final.usage == whole.usage
        deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
        assert deltas == ({"thinking_delta", "text_delta"} if "thinking" in kwargs else {"input_json_delta"})


def test_forced_tool_call_then_tool_result(server):
    c = client(server)
    question = ask("What is the weather in Paris? M-TOOL")
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        m = c.messages.create(model=MODEL, max_tokens=128, messages=question, tools=[WEATHER], tool_choice=choice)
        assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"
        call = m.content[0]
        assert call.id.startswith("toolu_") and call.name == "get_weather" and call.input == {"city": "Paris"}
        jsonschema.validate(call.input, WEATHER["input_schema"])
    conversation = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                             "content": [{"type": "text", "text": "TOOLRESULT-17"}]}]}]
    r = c.messages.create(model=MODEL, max_tokens=64, messages=conversation, tools=[WEATHER])
    assert r.content[0].text == "It is 17 degrees in Paris." and r.stop_reason == "end_turn"
    # what the model read: the call and its result through the chat template
    prompt = server.app.state.messages.prompt_ids
    chat = to_chat_request(MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 64, "messages": conversation, "tools": [WEATHER]}))
    text = server.llm.tokenizer.decode(prompt(chat, server.app.state.messages.chat_tools(chat)[1]))
    assert "<tool_response>\nTOOLRESULT-17\n</tool_response>" in text and '"city": "Paris"' in text


def test_system_messages_among_the_messages(server):
    """Claude Code (for a model it does not know as Claude) sends {"role": "system"} entries inside
    messages: each is read where it stands, as Qwen3's chat template writes a system message that is
    not first (its own <|im_start|>system turn), in create, stream and count_tokens alike."""
    c = client(server)
    conversation = [{"role": "user", "content": "Hello."},
                    {"role": "system", "content": "Be brief."},
                    {"role": "assistant", "content": "Hi."},
                    {"role": "system", "content": [{"type": "text", "text": "Answer in"},
                                                   {"type": "text", "text": "English.", "cache_control": {
                                                       "type": "ephemeral"}}]},
                    {"role": "user", "content": "M-PLAIN"}]
    m = c.messages.create(model=MODEL, max_tokens=64, system="You are a test.", messages=conversation)
    assert m.content[0].text == "No reasoning here."
    with c.messages.stream(model=MODEL, max_tokens=64, system="You are a test.", messages=conversation) as stream:
        assert stream.get_final_message().content[0].text == "No reasoning here."
    # the prompt is the template's text of the same conversation as chat messages
    chat = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hello."},
            {"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hi."},
            {"role": "system", "content": "Answer in\n\nEnglish."}, {"role": "user", "content": "M-PLAIN"}]
    text = server.llm.tokenizer.apply_chat_template(chat, enable_thinking=False)
    assert "<|im_start|>user\nHello.<|im_end|>\n<|im_start|>system\nBe brief.<|im_end|>\n" in text
    count = c.messages.count_tokens(model=MODEL, system="You are a test.", messages=conversation).input_tokens
    assert count == m.usage.input_tokens == len(server.llm.tokenizer.encode(text))
    # first, with no system field: the template's first system message
    first = c.messages.count_tokens(model=MODEL, messages=[{"role": "system", "content": "You are a test."}]
                                    + conversation[:1]).input_tokens
    assert first == c.messages.count_tokens(model=MODEL, system="You are a test.",
                                            messages=conversation[:1]).input_tokens
    # a system message holds text blocks only
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]"):
        c.messages.create(model=MODEL, max_tokens=8, messages=[conversation[0], {"role": "system", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "x", "input": {}}]}])


def test_tools_as_current_sdks_define_them(server):
    """eager_input_streaming, defer_loading, input_examples and allowed_callers on a tool are accepted
    (@ai-sdk/anthropic's streamText sends eager_input_streaming); the examples are shown to the model
    after the tool's description; a wrong value is a 400 that names the field by its path in the body."""
    c = client(server)
    examples = [{"city": "Paris"}, {"city": "Rome"}]
    tool = {**WEATHER, "eager_input_streaming": True, "defer_loading": False, "input_examples": examples,
            "allowed_callers": ["direct"], "strict": True}
    m = c.messages.create(model=MODEL, max_tokens=128, messages=ask("Weather? M-TOOL"), tools=[tool],
                          tool_choice={"type": "any"})
    assert [b.type for b in m.content] == ["tool_use"] and m.content[0].input == {"city": "Paris"}
    with c.messages.stream(model=MODEL, max_tokens=128, messages=ask("Weather? M-TOOL"), tools=[tool]) as stream:
        assert stream.get_final_message().content[0].input == {"city": "Paris"}
    chat = to_chat_request(MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 64, "messages": ask("x"), "tools": [tool]}))
    text = server.llm.tokenizer.decode(server.app.state.messages.prompt_ids(chat, server.app.state.messages.chat_tools(
        chat)[1]))
    assert 'Weather in a city\\n\\nInput examples:\\n{\\"city\\": \\"Paris\\"}\\n{\\"city\\": \\"Rome\\"}' in text, text
    plain = c.messages.count_tokens(model=MODEL, messages=ask("x"), tools=[WEATHER]).input_tokens
    assert c.messages.count_tokens(model=MODEL, messages=ask("x"), tools=[tool]).input_tokens > plain
    # errors name the field by its path in the body, never a class of npqwen's
    for bad, param in (({**tool, "eager_input_streaming": 3}, "tools[0].eager_input_streaming"),
                       ({**tool, "input_examples": ["Paris"]}, "tools[0].input_examples[0]"),
                       ({**tool, "bogus": 1}, "tools[0].bogus")):
        status, body = http_json("POST", server.url + "/v1/messages", {
            "model": MODEL, "max_tokens": 8, "messages": ask("x"), "tools": [bad]}, {"x-api-key": "k"})
        assert status == 400 and body["error"]["message"].startswith((param + ":", f"unsupported field '{param}'")), \
            body
    status, body = http_json("POST", server.url + "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x", "bogus": 1}]}]}, {"x-api-key": "k"})
    assert status == 400 and "'messages[0].content[0].bogus'" in body["error"]["message"], body


def test_the_sdks_tool_runner_goes_on_without_a_thread(tiny_server):
    """client.beta.messages.tool_runner sends `thread`; npqwen answers Anthropic's own refusal
    (error.details.error_code "thread_unsupported_request" with its `unsupported` list), on which the
    runner sends the whole conversation without one. Its loop then completes a forced tool call
    against the real tiny model: the call runs and its result goes back (before: it stopped at a 400)."""
    from typing import Literal

    from anthropic import beta_tool

    calls, sent = [], []

    @beta_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"17 degrees in {city}"

    c = anthropic.Anthropic(base_url=tiny_server.url, api_key="none", max_retries=0)
    create = c.beta.messages.create

    def recording_create(**kwargs):
        sent.append(kwargs)
        return create(**kwargs)
    c.beta.messages.create = recording_create
    runner = c.beta.messages.tool_runner(model=MODEL, max_tokens=200, tools=[get_weather], max_iterations=2,
                                         tool_choice={"type": "tool", "name": "get_weather"},
                                         messages=ask("Weather in Paris?"), extra_body={"temperature": 0})
    replies = list(runner)
    assert replies[0].stop_reason == "tool_use" and [b.type for b in replies[0].content] == ["tool_use"], replies[0]
    assert calls and calls[0] in ("Paris", "Rome") and len(replies) == 2
    results = [b for m in sent[-1]["messages"] if isinstance(m["content"], list) for b in m["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert results and "17 degrees in" in json.dumps(results[0]["content"]), sent[-1]["messages"]
    status, body = http_json("POST", tiny_server.url + "/v1/messages", {
        "model": MODEL, "max_tokens": 8, "messages": ask("x"), "thread": {"type": "create"}})
    assert status == 400 and body["error"]["details"] == {"error_code": "thread_unsupported_request",
                                                          "unsupported": []}, body


def test_output_config_format_and_stop_sequences(server):
    c = client(server)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    m = c.messages.create(model=MODEL, max_tokens=64, messages=ask("M-JSON"),
                          output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    m = c.messages.create(model=MODEL, max_tokens=64, messages=ask("M-STOP"), stop_sequences=["END"])
    assert m.content[0].text == "one two three " and m.stop_reason == "stop_sequence" and m.stop_sequence == "END"
    m = c.messages.create(model=MODEL, max_tokens=2, messages=ask("M-STOP"))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    # sampling values from the body (older SDKs and Claude Code send them there)
    m = c.messages.create(model=MODEL, max_tokens=64, messages=ask("M-PLAIN"),
                          extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    assert m.content[0].text == "No reasoning here."


def test_errors_are_the_sdks_exception_classes(server):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, api_key="wrong").messages.create(model=MODEL, max_tokens=8, messages=ask("M-PLAIN"))
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    # the key as Authorization: Bearer (auth_token) is as good as x-api-key
    bearer = anthropic.Anthropic(base_url=server.url, auth_token="k", max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=64, messages=ask("M-PLAIN")).content[0].text
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=ask("M-PLAIN"))
    assert e.value.body["error"]["type"] == "not_found_error" and MODEL in e.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    bad = [dict(messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]),
           dict(messages=ask("M-PLAIN"), tools=[{"type": "web_search_20250305", "name": "web_search"}]),
           dict(messages=ask("M-PLAIN"), tools=[WEATHER], tool_choice={"type": "tool", "name": "other"}),
           dict(messages=ask("M-PLAIN"), thinking={"type": "enabled"}),
           dict(messages=ask("M-PLAIN"), extra_body={"temperature": 1.5}),
           dict(messages=ask("M-PLAIN"), extra_body={"frequency_penalty": 1})]
    for kwargs in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model=MODEL, max_tokens=8, **kwargs)
        assert e.value.body["error"]["type"] == "invalid_request_error", kwargs
    assert "reads text" in e.value.body["error"]["message"] or True
    with pytest.raises(anthropic.BadRequestError, match="reads text only"):
        c.messages.create(model=MODEL, max_tokens=8, **bad[0])
    with pytest.raises(anthropic.BadRequestError, match="no room"):
        c.messages.create(model=MODEL, max_tokens=8, messages=ask("M-PLAIN " * 5000))
    status, body = http_json("POST", server.url + "/v1/messages", {"model": MODEL, "messages": ask("M-PLAIN")},
                             {"x-api-key": "k"})
    assert status == 400 and body["error"] == {"type": "invalid_request_error", "message": "'max_tokens' is required"}
    with pytest.raises(anthropic.ContentTooLargeError):
        c.messages.create(model=MODEL, max_tokens=8, messages=ask("x" * (17 * 1024 * 1024)))
    # the rest of Anthropic's statuses, as the server maps its own
    assert anthropic_error(APIError(429, "full", headers={"Retry-After": "1"}))[1]["error"]["type"] == \
        "rate_limit_error"
    assert anthropic_error(APIError(503, "stopping"))[0] == 529
    assert anthropic_error(APIError(500, "bug"))[1]["error"]["type"] == "api_error"
    # the OpenAI paths keep OpenAI's shape
    status, body = http_json("POST", server.url + "/v1/chat/completions", {"model": "other", "messages": ask("x")},
                             {"Authorization": "Bearer k"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_request_shaped_as_claude_code_sends_it(server):
    """System text blocks with cache_control, metadata.user_id, a tool whose input_schema has $schema,
    stream true, the anthropic-beta and anthropic-version headers and ?beta=true."""
    body = {"model": MODEL, "max_tokens": 32000, "stream": True, "temperature": 1,
            "metadata": {"user_id": "user_abc_account__session_123"},
            "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                        "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "You are an interactive CLI tool.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>As you answer, use the tools.</system-reminder>"},
                {"type": "text", "text": "Read README.md M-CODE", "cache_control": {"type": "ephemeral"}}]}],
            "tools": [{"name": "Read", "description": "Reads a file", "input_schema": {
                "type": "object", "properties": {"file_path": {"type": "string", "description": "absolute path"},
                                                 "limit": {"type": "number"}},
                "required": ["file_path"], "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#"}}]}
    request = urllib.request.Request(server.url + "/v1/messages?beta=true", data=json.dumps(body).encode(), headers={
        "content-type": "application/json", "x-api-key": "k", "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
        "user-agent": "claude-cli/2.0.0 (external, cli)", "x-app": "cli"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [(block.split("\n")[0].removeprefix("event: "), json.loads(block.split("\n")[1].removeprefix("data: ")))
              for block in raw.strip().split("\n\n")]
    names = [name for i, (name, _) in enumerate(events) if i == 0 or name != events[i - 1][0]]   # deltas as one
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"], events
    assert all(name == data["type"] for name, data in events)
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == "I will read the file." and events[-2][1]["delta"]["stop_reason"] == "end_turn"
    print("\nClaude-Code-shaped request:", names, events[-2][1])
    # the same through the SDK's beta client (it adds ?beta=true and the anthropic-beta header)
    del body["stream"], body["temperature"]
    with client(server).beta.messages.stream(**body, betas=["claude-code-20250219"]) as stream:
        assert stream.get_final_message().content[0].text == "I will read the file."
    # its billing header, first in the system blocks, changes with every request: it is left out of the prompt
    counts = set()
    for cch in ("", "fa690", "0aaa9"):
        header = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; "
                                           f"cch={cch};"}] if cch else []
        counts.add(client(server).messages.count_tokens(model=MODEL, system=header + body["system"],
                                                        messages=body["messages"], tools=body["tools"]).input_tokens)
    assert len(counts) == 1


def test_a_failure_mid_stream_is_an_error_event(server):
    """A prompt the script has no answer for makes the scripted model fail the engine's step, after
    message_start went out: the stream ends with Anthropic's error event, which the SDK raises."""
    events = []
    with pytest.raises(anthropic.APIStatusError) as e:
        with client(server).messages.stream(model=MODEL, max_tokens=16, messages=ask("unscripted")) as stream:
            for event in stream:
                events.append(event.type)
    assert events[0] == "message_start" and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "overloaded_error" and "engine failed" in e.value.body["error"]["message"]
    assert client(server).messages.create(model=MODEL, max_tokens=64, messages=ask("M-PLAIN")).content[0].text


def test_pings_while_nothing_else_comes():
    """A stream whose prompt takes long to read sends a ping each PING_SECONDS (here 0.05 s) until the first output."""
    async def slow_outputs():
        await asyncio.sleep(0.3)
        yield "first"

    async def run():
        return [item async for item in pinging(slow_outputs(), 0.05)]
    items = asyncio.run(run())
    assert items[-1] == "first" and set(items[:-1]) == {None} and len(items) >= 3


def test_metrics_and_openapi_count_and_document_the_routes(server):
    c = client(server)   # one call of each, so that the test stands alone (-k, another order)
    c.messages.create(model=MODEL, max_tokens=16, messages=ask("M-PLAIN"))
    c.messages.count_tokens(model=MODEL, messages=ask("M-PLAIN"))
    status, text = http_json("GET", server.url + "/metrics")
    assert 'npqwen:api_requests_total{endpoint="messages"}' in text
    assert 'npqwen:api_requests_total{endpoint="count_tokens"}' in text
    status, schema = http_json("GET", server.url + "/openapi.json")
    messages = schema["paths"]["/v1/messages"]["post"]["responses"]
    assert set(messages["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "401", "404", "413", "429", "529"} <= set(messages) and "503" not in messages
    assert messages["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/AnthropicError"
    assert "/v1/messages/count_tokens" in schema["paths"]


def test_nothing_above_made_the_server_log_an_error(server):
    assert not server.errors, [r.getMessage() for r in server.errors]


def test_prefix_cache_reads_and_streamed_text_equals_created_at_temperature_0(tiny_server):
    """The real tiny model: greedy text streamed and whole agree; a repeated prompt is read from the cache."""
    c = anthropic.Anthropic(base_url=tiny_server.url, api_key="none", max_retries=0)
    long = "The prefix cache keeps the pages of this long question. " * 8
    kwargs = dict(model=MODEL, max_tokens=12, messages=ask(long), extra_body={"temperature": 0})
    first = c.messages.create(**kwargs)
    with c.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == first.content[0].text
    count = c.messages.count_tokens(model=MODEL, messages=ask(long)).input_tokens
    assert first.usage.input_tokens == count and first.usage.cache_read_input_tokens == 0
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count


def test_thinking_budget_tokens_and_effort_cap_the_reasoning(tiny_server):
    """The real tiny model (it never closes its reasoning alone): with output_config.format it opens it,
    and the engine ends it at thinking.budget_tokens, or (adaptive) at half of max_tokens, the
    constrained answer's own rule; output_config.effort is the chat's reasoning_effort, with its budgets."""
    c = anthropic.Anthropic(base_url=tiny_server.url, api_key="none", max_retries=0)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}
    tokens = tiny_server.llm.tokenizer.encode
    spent = {}
    for name, thinking in (("budget 3", {"type": "enabled", "budget_tokens": 3}), ("adaptive", {"type": "adaptive"})):
        m = c.messages.create(model=MODEL, max_tokens=64, messages=ask("hi"), thinking=thinking,
                              output_config={"format": {"type": "json_schema", "schema": schema}},
                              extra_body={"temperature": 0})
        assert [b.type for b in m.content] == ["thinking", "text"], (name, m.content)
        if m.stop_reason == "end_turn":   # random weights may spend the rest on the JSON's whitespace
            jsonschema.validate(json.loads(m.content[1].text), schema)
        # "<think>" and the reasoning: what is left of output_tokens after the close, the answer and eos
        # (at most: newlines the answer may open with are not in its text)
        closing = len(tokens("\n</think>\n\n")) + len(tokens(m.content[1].text)) + (m.stop_reason == "end_turn")
        spent[name] = m.usage.output_tokens - closing
    assert spent["budget 3"] <= 3 < spent["adaptive"] <= 64 // 2, spent
    messages = tiny_server.app.state.messages
    for effort, budget in (("low", 1024), ("high", 16384), ("max", None)):
        chat = to_chat_request(MessagesRequest.model_validate({
            "model": MODEL, "max_tokens": 64, "messages": ask("hi"), "thinking": {"type": "adaptive"},
            "output_config": {"effort": effort}}))
        assert messages.thinking(chat) and messages.budget(chat) == budget
    with pytest.raises(anthropic.BadRequestError, match="greater than thinking.budget_tokens"):
        c.messages.create(model=MODEL, max_tokens=64, messages=ask("hi"),
                          thinking={"type": "enabled", "budget_tokens": 64})
