"""What real clients send and read: ids beyond int64, calls larger than the queue, usage of a list
of prompts, bodies without a JSON Content-Type, image parts, "bearer" in lower case, whole-number
floats, 405's Allow, legacy logprobs' text_offset and distinct keys, endpoints not served."""
import http.client
import json
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402

from serving import LiveServer, http_json  # noqa: E402

KEY = {"Authorization": "Bearer k"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    llm = npqwen.load("tiny")
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=8192, page_size=16), api_key="k", max_queue=4)
    yield server
    server.close()


def raw_post(server, path: str, body: bytes, headers: dict) -> tuple[int, dict, dict]:
    """(status, JSON answer, headers) of a POST sent exactly as given (no Content-Type unless in headers)."""
    target = urlparse(server.url)
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
    conn.request("POST", path, body, headers)
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    return response.status, answer, dict(response.getheaders())


def refused(call, status: int):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status, (info.value.status_code, info.value.body)
    return info.value


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "test-model", "prompt": [9223372036854775808]}, "prompt"),
    ("/v1/completions", {"model": "test-model", "prompt": [[1, 2], [-9223372036854775809]]}, "prompt"),
    ("/detokenize", {"tokens": [5, 9223372036854775808]}, "tokens"),
    ("/v1/npqwen/attention", {"tokens": [18446744073709551616], "layer": 0}, "tokens"),
])
def test_token_ids_beyond_int64_are_a_400(server, path, body, param):
    status, answer = http_json("POST", server.url + path, body, KEY)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert "outside the vocabulary" in answer["error"]["message"], answer
    assert not server.errors, [r.getMessage() for r in server.errors]


def test_a_call_larger_than_the_queue_is_a_400_not_a_429(server):
    client = server.client(api_key="k")
    e = refused(lambda: client.completions.create(model="test-model", prompt=["a", "b", "c", "d", "e"],
                                                  max_tokens=1), 400)
    assert e.param == "prompt" and e.code == "too_many_requests" and "--max-queue 4" in e.message, e.body
    e = refused(lambda: client.completions.create(model="test-model", prompt=["a", "b"], n=3, max_tokens=1), 400)
    assert e.param == "n" and "2 prompts x n = 6 requests" in e.message, e.body
    assert client.completions.create(model="test-model", prompt=["a", "b"], n=2, max_tokens=1).usage


def test_usage_counts_every_prompt_of_a_list(server):
    client = server.client(api_key="k")
    prompts = ["one", "three", "seven"]
    out = client.completions.create(model="test-model", prompt=prompts, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == 3 + 5 + 5 and out.usage.completion_tokens == 3 * 2, out.usage
    out = client.completions.create(model="test-model", prompt=prompts[1:], max_tokens=2, n=2, temperature=0)
    assert out.usage.prompt_tokens == 5 + 5 and out.usage.completion_tokens == 2 * 2 * 2, out.usage   # n shares it
    stream = client.completions.create(model="test-model", prompt=prompts, max_tokens=2, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    assert list(stream)[-1].usage.prompt_tokens == 13


def test_bodies_without_a_json_content_type(server):
    body = json.dumps({"model": "test-model", "messages": USER, "max_tokens": 2}).encode()
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        status, answer, _ = raw_post(server, "/v1/chat/completions", body, {**KEY, **headers})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, (headers, answer)
    status, answer, _ = raw_post(server, "/v1/chat/completions", b"model=test-model&prompt=hi",
                                 {**KEY, "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 400 and "Content-Type: application/x-www-form-urlencoded" in answer["error"]["message"], answer
    assert "application/json" in answer["error"]["message"]


def test_an_image_part_is_refused_as_an_image(server):
    client = server.client(api_key="k")
    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}):
        messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
        e = refused(lambda: client.chat.completions.create(model="test-model", messages=messages), 400)
        assert e.param == "messages[0].content[1].type" and "text only" in e.message, e.body
        status, answer = http_json("POST", server.url + "/tokenize", {"messages": messages}, KEY)
        assert status == 400 and answer["error"]["param"] == "messages[0].content[1].type", answer


def test_bearer_in_lower_case(server):
    for value in ("bearer k", "BEARER k", "Bearer  k "):
        status, answer = http_json("GET", server.url + "/v1/models", headers={"Authorization": value})
        assert status == 200, (value, answer)
    for value in ("bearer kk", "Basic k", "k"):
        assert http_json("GET", server.url + "/v1/models", headers={"Authorization": value})[0] == 401, value


def test_whole_number_floats_are_integers(server):
    body = {"model": "test-model", "messages": USER, "max_tokens": 3.0, "n": 2.0, "seed": 7.0, "top_logprobs": 2.0,
            "logprobs": True, "temperature": 0}
    status, answer = http_json("POST", server.url + "/v1/chat/completions", body, KEY)
    assert status == 200 and answer["usage"]["completion_tokens"] == 6 and len(answer["choices"]) == 2, answer
    status, answer = http_json("POST", server.url + "/v1/completions",
                               {"model": "test-model", "prompt": "x", "max_tokens": 2.0, "logprobs": 1.0}, KEY)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    for field, value in (("max_tokens", 2.5), ("n", True), ("max_tokens", "2")):
        status, answer = http_json("POST", server.url + "/v1/chat/completions",
                                   {"model": "test-model", "messages": USER, field: value}, KEY)
        assert status == 400 and answer["error"]["param"] == field, (field, value, answer)


def test_405_says_which_methods(server):
    target = urlparse(server.url)
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
    conn.request("GET", "/v1/chat/completions", headers=KEY)
    response = conn.getresponse()
    answer = json.loads(response.read())
    assert response.status == 405 and response.getheader("Allow") == "POST", response.getheaders()
    assert answer["error"]["code"] == "method_not_allowed" and "POST" in answer["error"]["message"], answer


def test_endpoints_not_served_say_what_they_are(server):
    for path, words in (("/v1/embeddings", "embeddings"), ("/v1/rerank", "rerank"), ("/v2/rerank", "rerank")):
        status, answer = http_json("POST", server.url + path, {"model": "test-model", "input": "x"}, KEY)
        assert status == 404 and words in answer["error"]["message"] and "not served" in answer["error"]["message"]
    status, answer = http_json("POST", server.url + "/v1/nope", {}, KEY)
    assert status == 404 and "/v1/nope" in answer["error"]["message"], answer


def test_legacy_logprobs_text_offset_and_distinct_keys(server, reference_tokenizer):
    """The tiny model writes many byte tokens that are pieces of UTF-8 characters; each prints as
    U+FFFD, so as text keys of top_logprobs they would collapse into one."""
    client = server.client(api_key="k")
    kwargs = dict(model="test-model", prompt="Name a colour:", max_tokens=24, logprobs=5, temperature=1.0, seed=3)
    out = client.completions.create(**kwargs, extra_body={"top_k": 0, "return_token_ids": True})
    choice = out.choices[0]
    lp, text, ids = choice.logprobs, choice.text, choice.model_extra["token_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) == 24
    assert sum(t.startswith("bytes:") for t in lp.tokens), "no piece of a character drawn: pick another seed"
    for i, (token, top) in enumerate(zip(ids, lp.top_logprobs)):
        raw = reference_tokenizer.token_bytes(token)
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:   # OpenAI's way of writing a piece of a character
            key = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        assert lp.tokens[i] == key
        assert len(top) in (5, 6) and top[key] == lp.token_logprobs[i], top   # the 5 most likely and the token drawn
        # the token's text is where its offset says (a piece of a character: at that character)
        if not key.startswith("bytes:") and token not in (256, 258):
            assert text[lp.text_offset[i]:lp.text_offset[i] + len(key)] == key, (i, key, lp.text_offset[i])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: the offsets go on from chunk to chunk
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"top_k": 0}))
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == lp.tokens


@pytest.fixture(scope="module")
def reference_tokenizer():
    return npqwen.load("tiny").tokenizer


def test_nothing_above_made_the_server_log_an_error(server):
    assert not server.errors, [r.getMessage() for r in server.errors]
