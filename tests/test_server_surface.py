"""What vLLM's and llama.cpp's users send: `model` left out (the one served), stop_token_ids, HEAD
/health, /version, the Responses API's truncation "auto"; a request for text from an embedding model
is a 400 unless the server allows it; a lone surrogate is refused in npqwen's words."""
import http.client
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402

from serving import LiveServer, http_json  # noqa: E402

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    server = LiveServer(npqwen.load("tiny"))
    yield server
    server.close()


def test_model_left_out_is_the_one_served(server):
    """Before: 400 "'model' is required"."""
    for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2})):
        status, answer = http_json("POST", server.url + path, body)
        assert status == 200 and answer["model"] == "test-model", (path, answer)
    status, answer = http_json("POST", server.url + "/v1/chat/completions", {"model": "other", "messages": USER})
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_stop_token_ids_end_the_answer(server):
    """Before: 400 unknown field stop_token_ids."""
    free = http_json("POST", server.url + "/v1/completions", {"prompt": "a", "max_tokens": 12, "temperature": 0,
                                                               "return_token_ids": True})[1]["choices"][0]
    third = free["token_ids"][2]
    status, answer = http_json("POST", server.url + "/v1/completions", {
        "prompt": "a", "max_tokens": 12, "temperature": 0, "return_token_ids": True, "stop_token_ids": [third]})
    choice = answer["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert choice["token_ids"] == free["token_ids"][:free["token_ids"].index(third) + 1]
    status, answer = http_json("POST", server.url + "/v1/chat/completions", {"messages": USER,
                                                                           "stop_token_ids": [10 ** 6]})
    assert status == 400 and answer["error"]["param"] == "stop_token_ids"


def test_head_health_and_version(server):
    target = urlparse(server.url)
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
    conn.request("HEAD", "/health")
    response = conn.getresponse()
    assert response.status == 200 and response.read() == b""   # before: 405
    conn.close()
    assert http_json("GET", server.url + "/version") == (200, {"version": npqwen.__version__})   # before: 404


def test_head_is_get_without_the_body(server):
    """Uptime checks send HEAD /: every GET route answers HEAD as GET, with GET's headers and no body
    (before: 405 on / and every route but /health); a POST route still refuses it."""
    target = urlparse(server.url)
    for path in ("/", "/health", "/version", "/v1/models", "/v1/models/test-model", "/metrics", "/openapi.json",
                 "/tokenizer_info", "/static/app.js"):
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        conn.request("GET", path)
        get = conn.getresponse()
        body = get.read()
        conn.request("HEAD", path)
        head = conn.getresponse()
        assert head.status == get.status == 200 and head.read() == b"", (path, head.status)
        assert head.getheader("content-type") == get.getheader("content-type"), path
        if path not in ("/metrics", "/health"):   # their text changes between two calls
            assert int(head.getheader("content-length")) == len(body), path
        conn.close()
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
    conn.request("HEAD", "/v1/chat/completions")
    response = conn.getresponse()
    assert response.status == 405 and response.read() == b"" and response.getheader("allow") == "POST"
    conn.close()


def test_stream_options_include_obfuscation_is_accepted(server):
    """OpenAI's stream_options.include_obfuscation (before: a 400): npqwen adds no padding either way."""
    client = server.client(api_key="none")
    for obfuscation in (True, False):
        chunks = list(client.chat.completions.create(model="test-model", messages=USER, max_tokens=2, stream=True,
                                                     stream_options={"include_usage": True,
                                                                     "include_obfuscation": obfuscation}))
        assert chunks[-1].usage.completion_tokens == 2
        assert not any("obfuscation" in (chunk.model_extra or {}) for chunk in chunks)
        stream = client.completions.create(model="test-model", prompt="a", max_tokens=2, stream=True,
                                           stream_options={"include_obfuscation": obfuscation})
        assert "".join(c.choices[0].text for c in stream if c.choices)


def test_responses_truncation_auto_drops_the_oldest_items():
    """Before: truncation "auto" was accepted, and an input too long for the context still a 400."""
    llm = npqwen.load("tiny")
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=1024, page_size=16))
    try:
        old = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 60} for i in range(8)]
        body = {"input": old + [{"role": "user", "content": "and now?"}], "instructions": "Be brief.",
                "max_output_tokens": 100, "temperature": 0}
        status, answer = http_json("POST", server.url + "/v1/responses", body)
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
        status, answer = http_json("POST", server.url + "/v1/responses", {**body, "truncation": "auto"})
        assert status == 200, answer
        kept = answer["usage"]["input_tokens"]
        assert kept + 100 <= 1024 and kept > 1024 - 100 - 2 * 310   # dropped only what it had to
    finally:
        server.close()


def test_text_from_an_embedding_model_is_refused_unless_allowed(embedding_small):
    llm = npqwen.load(embedding_small)
    for allowed in (False, True):
        server = LiveServer(llm, model_name="emb", allow_generation=allowed)
        try:
            for path, body in (("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
                               ("/v1/completions", {"prompt": "a", "max_tokens": 2})):
                status, answer = http_json("POST", server.url + path, body)
                if allowed:
                    assert status == 200, answer
                else:   # before: 200 with text
                    assert status == 400 and answer["error"]["code"] == "model_not_supported"
                    assert "embedding model" in answer["error"]["message"] and "/v1/embeddings" in \
                        answer["error"]["message"]
            assert http_json("POST", server.url + "/v1/embeddings", {"input": "a"})[0] == 200
        finally:
            server.close()


def test_a_lone_surrogate_is_refused_in_npqwens_words(server):
    status, answer = http_json("POST", server.url + "/v1/chat/completions",
                               b'{"messages": [{"role": "user", "content": "a \\ud800"}]}')
    message = answer["error"]["message"]
    assert status == 400 and "U+D800" in message and "TextEncodeInput" not in message, message


def test_metrics_have_the_dashboards_histograms_and_gauges(server):
    """Before: counters, one histogram and npqwen_-prefixed gauges only."""
    def scrape() -> dict:
        text = http_json("GET", server.url + "/metrics")[1]
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("npqwen:")}

    before = scrape()
    status, _ = http_json("POST", server.url + "/v1/completions", {"prompt": "ab", "max_tokens": 5, "temperature": 0,
                                                                   "ignore_eos": True})
    after = scrape()
    assert status == 200
    for name, grew in (("time_to_first_token_seconds_count", 1), ("time_per_output_token_seconds_count", 4),
                       ("e2e_request_latency_seconds_count", 1), ("request_queue_time_seconds_count", 1),
                       ("request_prompt_tokens_count", 1), ("request_generation_tokens_count", 1),
                       ("request_generation_tokens_sum", 5), ("generation_tokens_total", 5)):
        assert after["npqwen:" + name] - before.get("npqwen:" + name, 0) == grew, name
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after["npqwen:" + gauge] == 0, gauge


def test_the_cli_refuses_text_from_an_embedding_model(embedding_small):
    from test_cli import run

    code, _, err = run("generate", "-m", str(embedding_small), "-p", "hi", "-n", "2")
    assert code == 1 and "is an embedding model" in err and "npqwen embed" in err   # before: text, exit 0
