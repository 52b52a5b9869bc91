"""Every error a client can cause gets OpenAI's shape and status, and the server keeps serving;
a client that goes away has its request aborted before the next engine step."""
import http.client
import json
import socket
import time
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402

from serving import LiveServer, SlowModel, http_json  # noqa: E402

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    llm = npqwen.load("tiny")
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=4096, page_size=16), api_key="sekret",
                        max_body_bytes=20_000)
    yield server
    server.close()


def refused(call, status: int):
    """The openai client's exception for a call the server refuses with `status`."""
    with pytest.raises(openai.APIStatusError) as info:
        call()
    e = info.value
    assert e.status_code == status, (e.status_code, e.body)
    assert set(e.body) == {"message", "type", "param", "code"}, e.body   # OpenAI's shape, under "error"
    return e


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=9), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_completion_tokens=-3), "max_completion_tokens"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=3), "top_logprobs"),                          # without logprobs
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(seed="7"), "seed"),
    (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(logit_bias={"42": 5}), "logit_bias"),
    (dict(tool_choice="required"), "tool_choice"),                   # without tools
    (dict(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"guided_json": {}}), "guided_json"),           # a field npqwen does not know
    (dict(extra_body={"chat_template_kwargs": {"enable_thinking": "yes"}}), "chat_template_kwargs.enable_thinking"),
    (dict(extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}), "chat_template_kwargs.reasoning_effort"),
])
def test_chat_validation_is_a_400_naming_the_field(server, kwargs, param):
    client = server.client(api_key="sekret")
    e = refused(lambda: client.chat.completions.create(model="test-model", messages=USER, **kwargs), 400)
    assert e.param == param and e.type == "invalid_request_error", e.body


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": 42}], "messages[0].content"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi", "colour": "red"}], "messages[0].colour"),
])
def test_bad_messages(server, messages, param):
    client = server.client(api_key="sekret")
    e = refused(lambda: client.chat.completions.create(model="test-model", messages=messages), 400)
    assert e.param == param, e.body


def test_completions_validation(server):
    client = server.client(api_key="sekret")
    for kwargs, param in [(dict(prompt="x", max_tokens=0), "max_tokens"), (dict(prompt="x", suffix="y"), "suffix"),
                          (dict(prompt="x", best_of=3), "best_of"), (dict(prompt="x", logprobs=21), "logprobs"),
                          (dict(prompt=[1, 99999]), "prompt"), (dict(prompt=[]), "prompt"),
                          (dict(prompt=""), "prompt"), (dict(prompt=[[1, 2], "x"]), "prompt[1]"),
                          (dict(prompt={"a": 1}), "prompt")]:
        e = refused(lambda: client.completions.create(model="test-model", **kwargs), 400)
        assert e.param == param, (kwargs, e.body)


def test_prompt_plus_max_tokens_over_the_context(server):
    client = server.client(api_key="sekret")
    context = server.llm.config.max_position_embeddings      # 4096
    e = refused(lambda: client.completions.create(model="test-model", prompt="abcd", max_tokens=context), 400)
    assert e.code == "context_length_exceeded" and e.param == "prompt"
    assert f"{context} tokens" in e.message and "4 prompt tokens" in e.message and str(context + 4) in e.message
    e = refused(lambda: client.chat.completions.create(model="test-model", messages=USER, max_tokens=context), 400)
    assert e.param == "messages" and "prompt tokens" in e.message


def test_api_key_and_unknown_model(server):
    e = refused(lambda: server.client(api_key="wrong").models.list(), 401)
    assert e.code == "invalid_api_key"
    status, body = http_json("GET", server.url + "/v1/models")                  # no key at all
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert http_json("GET", server.url + "/health")[0] == 200                   # open without a key
    client = server.client(api_key="sekret")
    e = refused(lambda: client.chat.completions.create(model="gpt-4o", messages=USER), 404)
    assert e.param == "model" and e.code == "model_not_found"


def test_bodies_the_server_cannot_read(server):
    key = {"Authorization": "Bearer sekret"}
    url = server.url + "/v1/chat/completions"
    for body, what in [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                       (b'{"model": "test-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "JSON"),
                       (b"", "JSON object")]:
        status, answer = http_json("POST", url, body, key)
        assert status == 400 and what in answer["error"]["message"], (body, answer)
    status, answer = http_json("POST", url, {"model": "test-model", "messages": [{"role": "user", "content": "x" * 30_000}]},
                          key)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    # a body sent in chunks, without Content-Length, is cut off as it arrives
    target = urlparse(url)
    conn = http_client(target)
    conn.putrequest("POST", target.path)
    for name, value in {**key, "Content-Type": "application/json", "Transfer-Encoding": "chunked"}.items():
        conn.putheader(name, value)
    conn.endheaders()
    for _ in range(30):
        chunk = b" " * 1000
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    conn.send(b"0\r\n\r\n")
    response = conn.getresponse()
    assert response.status == 413, response.read()
    assert http_json("GET", server.url + "/v1/nope", headers=key)[1]["error"]["code"] == "not_found"


def test_still_serving_after_every_error(server):
    client = server.client(api_key="sekret")
    out = client.chat.completions.create(model="test-model", messages=USER, max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    deadline = time.monotonic() + 5   # the answer can reach the client a moment before the engine forgets the request
    while server.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.loop.alive and not server.engine.has_unfinished()
    assert not server.errors, [r.getMessage() for r in server.errors]   # nothing above made it log an error


# -- a busy server: queue limit and clients that go away --

@pytest.fixture(scope="module")
def slow_server():
    """One request at a time, 40 ms per step: a queue forms and a step can be watched."""
    llm = npqwen.load("tiny")
    llm.model = SlowModel(llm.model, 0.04)
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=4096, page_size=16, max_batch_size=1),
                        max_queue=2)
    yield server
    server.close()


def http_client(target):
    return http.client.HTTPConnection(target.hostname, target.port, timeout=30)


# greedy: the tiny model writes no eos in 3000 tokens after "hi", so these requests are still running
# when the test acts (a sampled one may draw eos within a few tokens and finish first)
LONG = {"max_tokens": 400, "temperature": 0}


def open_stream(server, body: dict):
    """A streaming chat request on a raw connection; (connection, response) once the headers are in."""
    target = urlparse(server.url)
    conn = http_client(target)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "test-model", "messages": USER,
                                                              "stream": True, **body}),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def events(response):
    """The data events of an SSE response, parsed, as they arrive."""
    for line in response:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            yield None if data == b"[DONE]" else json.loads(data)


def test_queue_full_is_a_429(slow_server):
    busy = [open_stream(slow_server, LONG) for _ in range(3)]   # 1 running, 2 waiting
    deadline = time.monotonic() + 5
    while slow_server.engine.stats["waiting"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    e = refused(lambda: slow_server.client().chat.completions.create(model="test-model", messages=USER), 429)
    assert e.code == "queue_full" and e.response.headers["retry-after"] == "1"   # a real 429 says when
    for path, body in (("/v1/embeddings", {"model": "test-model", "input": ["a", "b"]}),   # the other roads
                       ("/v1/npqwen/attention", {"tokens": [1, 2], "layer": 0})):
        conn = http_client(urlparse(slow_server.url))
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 429 and response.getheader("Retry-After") == "1", (path, response.read())
        assert json.loads(response.read())["error"]["code"] == "queue_full"
        conn.close()
    for conn, _ in busy:
        conn.close()
    assert slow_server.wait_idle() < 1.0


def test_disconnect_while_streaming_frees_the_request_within_a_step(slow_server):
    engine = slow_server.engine
    conn, response = open_stream(slow_server, LONG)
    stream = events(response)
    first = next(stream)
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert set(next(stream)["choices"][0]["delta"]) & {"content", "reasoning_content"}   # a token came
    assert engine.stats["running"] == 1
    conn.close()
    idle = slow_server.wait_idle()
    assert idle < 2 * 0.04 + 0.15, f"the request outlived its client by {idle:.3f} s"
    stats = engine.stats
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats
    # the next request starts at once: its first token comes within a few steps
    started = time.monotonic()
    conn, response = open_stream(slow_server, {"max_tokens": 2})
    chunks = [e for e in events(response) if e is not None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and time.monotonic() - started < 1.0
    conn.close()


def test_disconnect_while_queued_and_while_waiting_for_a_whole_answer(slow_server):
    engine = slow_server.engine
    running, response = open_stream(slow_server, LONG)
    next(events(response))
    queued, _ = open_stream(slow_server, LONG)
    deadline = time.monotonic() + 5
    while engine.stats["waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    queued.close()
    started = time.monotonic()
    while engine.stats["waiting"]:
        assert time.monotonic() - started < 0.2, "the queued request outlived its client"
        time.sleep(0.005)
    assert engine.stats["running"] == 1
    running.close()
    assert slow_server.wait_idle() < 0.2
    # not streamed: the client gives up waiting for the whole answer
    target = urlparse(slow_server.url)
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=0.3)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": "test-model", "messages": USER,
                                                              **LONG}), {"Content-Type": "application/json"})
    try:
        answer = conn.getresponse()
        pytest.fail(f"expected no answer within 0.3 s, got {answer.status}: {answer.read()[:300]!r}")
    except TimeoutError:
        pass
    conn.close()
    assert slow_server.wait_idle() < 0.2
    stats = engine.stats
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"], stats


def test_the_error_log_check_bites():
    """A bug planted in a handler: the client gets OpenAI's 500 shape, and LiveServer.errors sees the traceback."""
    llm = npqwen.load("tiny")
    planted = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=1024, page_size=16))
    try:
        def broken(body):
            raise RuntimeError("planted")
        planted.app.state.tokenization.tokenize = broken
        status, body = http_json("POST", planted.url + "/tokenize", {"prompt": "hi"})
        assert status == 500 and body["error"]["type"] == "server_error", body
        deadline = time.monotonic() + 5   # uvicorn logs it after the response has gone out
        while not planted.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert planted.errors and planted.errors[0].exc_info[0] is RuntimeError
    finally:
        planted.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_messages_call_whose_client_left_during_its_prefill_stops_within_a_chunk(stream):
    """Claude Code gives up on a stream (at 5 minutes unless told otherwise: docs/messages.md) and sends
    the same request again, streamed or not: the one it left must not hold the engine. Here a prompt of
    ~100 chunks at 0.2 s a chunk; the client leaves during the prefill (streamed: after message_start),
    and within a chunk and the disconnect poll the engine runs nothing (npqwen:num_requests_running 0)
    and has nothing waiting."""
    llm = npqwen.load("tiny")
    llm.model = SlowModel(llm.model, 0.2)
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=4096, page_size=16, max_batched_tokens=32))
    try:
        target = urlparse(server.url)
        conn = http_client(target)
        conn.request("POST", "/v1/messages", json.dumps({
            "model": "test-model", "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": "word " * 640}]}), {"Content-Type": "application/json"})
        if stream:
            response = conn.getresponse()
            assert response.status == 200 and response.readline().startswith(b"event: message_start")
        deadline = time.monotonic() + 5
        while server.engine.stats["running"] == 0:   # the prefill is under way
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        assert server.engine.stats["running"] == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        left = time.monotonic()
        while True:
            metrics = http_json("GET", server.url + "/metrics")[1]
            if "npqwen:num_requests_running 0.0" in metrics and "npqwen:num_requests_waiting 0.0" in metrics:
                break
            assert time.monotonic() - left < 3, "the abandoned request still runs"
            time.sleep(0.05)
        print(f"\nthe abandoned request stopped {time.monotonic() - left:.2f} s after its client left "
              f"(a chunk takes 0.2 s; the whole prefill ~20 s)")
        assert not server.engine.has_unfinished()
    finally:
        server.close()
