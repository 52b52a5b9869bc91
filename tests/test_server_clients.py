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

from serving import LiveServer, http_json, reference  # noqa: E402,F401  (a fixture)
from tolerance import logprob_tolerance  # noqa: E402

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


def test_an_unknown_endpoint_is_a_404_that_names_it(server):
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


# -- fields real clients send --

THINK_OFF = "<think>\n\n</think>\n\n"
SCRIPT = {"Q-PLAIN": THINK_OFF + "Plain answer.", "Q-CONT": THINK_OFF + "The answer is 42."}


@pytest.fixture(scope="module")
def scripted_server():
    from serving import scripted_server

    yield from scripted_server(SCRIPT)


def plain(server, **kwargs):
    return server.client().chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Q-PLAIN"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, **kwargs.pop("extra_body", {})}, **kwargs)


def test_openai_service_fields_are_accepted_and_logged_once(scripted_server):
    import logging

    logger, seen = logging.getLogger("uvicorn.error"), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        fields = dict(store=False, metadata={"run": "7"}, service_tier="auto", prompt_cache_key="k1",
                      safety_identifier="user-1", user="u", extra_body={"verbosity": "low"})
        for _ in range(2):
            assert plain(scripted_server, **fields).choices[0].message.content == "Plain answer."
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    ignored = [m for m in seen if "accepted and ignored" in m]
    assert len(ignored) == 7 and all(any(f"'{f}'" in m for m in ignored) for f in
                                      ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                                       "user", "verbosity")), seen


def test_reasoning_effort_turns_qwen3_thinking_on_or_off(server, reference_tokenizer):
    for effort, off in (("none", True), ("minimal", True), ("low", False), ("high", False), (None, False)):
        extra = {"return_token_ids": True, **({"reasoning_effort": effort} if effort else {})}
        out = server.client(api_key="k").chat.completions.create(model="test-model", messages=USER, max_tokens=1,
                                                                 extra_body=extra)
        prompt = reference_tokenizer.decode(out.model_extra["prompt_token_ids"])
        assert prompt.endswith(THINK_OFF) == off, (effort, prompt[-40:])


def test_vllm_sampling_extras(scripted_server):
    # ignore_eos: on to max_tokens, eos and all; skip_special_tokens leaves the eos text out
    out = plain(scripted_server, max_tokens=20, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 20
    assert out.choices[0].message.content.startswith("Plain answer.<|im_end|><|im_end|>")
    out = plain(scripted_server, max_tokens=20, extra_body={"ignore_eos": True, "skip_special_tokens": True})
    assert out.choices[0].message.content == "Plain answer." and out.usage.completion_tokens == 20
    # min_tokens: no eos before it (the script then writes byte 0 until it may end), and no stop string
    out = plain(scripted_server, stop=["answer"], temperature=0, extra_body={"min_tokens": 20})
    assert out.usage.completion_tokens == 21 and out.choices[0].message.content == "Plain answer." + "\x00" * 7
    # include_stop_str_in_output
    out = plain(scripted_server, stop=["answer"], extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].message.content == "Plain answer" and out.choices[0].finish_reason == "stop"
    chunks = list(plain(scripted_server, stop=["answer"], stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Plain answer"
    e = refused(lambda: plain(scripted_server, max_tokens=5, extra_body={"min_tokens": 6}), 400)
    assert e.param == "min_tokens"


def test_continue_final_message(scripted_server, server):
    messages = [{"role": "user", "content": "Q-CONT"}, {"role": "assistant", "content": "The answer is"}]
    client = scripted_server.client()
    out = client.chat.completions.create(model="test-model", messages=messages, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True})
    assert out.choices[0].message.content == " 42.", out.choices[0].message
    prompt = scripted_server.llm.tokenizer.decode(out.model_extra["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\n" + THINK_OFF + "The answer is"), prompt[-80:]
    e = refused(lambda: client.chat.completions.create(model="test-model", messages=messages,
                                                       extra_body={"continue_final_message": True}), 400)
    assert e.param == "continue_final_message" and "add_generation_prompt" in e.message
    e = refused(lambda: client.chat.completions.create(model="test-model", messages=messages[:1], extra_body={
        "add_generation_prompt": False, "continue_final_message": True}), 400)
    assert "assistant message last" in e.message
    # add_generation_prompt false alone: the conversation as it stands, ending with its last <|im_end|>
    ids = server.client(api_key="k").chat.completions.create(model="test-model", messages=messages, max_tokens=1,
                                                             extra_body={"add_generation_prompt": False,
                                                                         "return_token_ids": True})
    assert server.llm.tokenizer.decode(ids.model_extra["prompt_token_ids"]).endswith("The answer is<|im_end|>\n")


def test_tokenizer_info_tokenize_add_special_tokens_and_chat_prompt_logprobs(server, reference):
    status, info = http_json("GET", server.url + "/tokenizer_info", headers=KEY)
    assert status == 200 and info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == reference.config.max_position_embeddings
    for special in (True, False, None):
        body = {"prompt": "hello", **({"add_special_tokens": special} if special is not None else {})}
        assert http_json("POST", server.url + "/tokenize", body, KEY)[1]["tokens"] == \
            reference.tokenizer.encode("hello")   # Qwen3's tokenizer adds nothing around a text
    status, out = http_json("POST", server.url + "/v1/chat/completions", {
        "model": "test-model", "messages": USER, "max_tokens": 1, "prompt_logprobs": 1, "return_token_ids": True}, KEY)
    ids = out["prompt_token_ids"]
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(ids)
    want = reference.score(ids).logprobs
    got = [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], out["prompt_logprobs"][1:])]
    # the server's chat request against llm.score of the same ids: another engine and batch, the same sums
    assert max(abs(a - b) for a, b in zip(got, want)) <= logprob_tolerance(reference.config, len(ids), reference.forward(ids))
    status, out = http_json("POST", server.url + "/v1/chat/completions", {
        "model": "test-model", "messages": USER, "prompt_logprobs": 1, "stream": True}, KEY)
    assert status == 400 and out["error"]["param"] == "prompt_logprobs"


def test_nothing_above_made_either_server_log_an_error(server, scripted_server):
    for s in (server, scripted_server):
        assert not s.errors, [r.getMessage() for r in s.errors]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(server):
    """usage.prompt_tokens_details.cached_tokens (chat, completions, the Responses API's
    input_tokens_details): 0 for a new prompt, its full cached pages (16 positions each) the second time."""
    client = server.client(api_key="k")
    prompt = "A prompt of its own for the cache count: " + "seven words make up this phrase. " * 12
    first = client.completions.create(model="test-model", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="test-model", prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    print("prompt tokens", n, "cached", first.usage.prompt_tokens_details, again.usage.prompt_tokens_details)
    assert n > 64 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16   # its last token is computed
    messages = [{"role": "user", "content": prompt}]
    chats = [client.chat.completions.create(model="test-model", messages=messages, max_tokens=2) for _ in range(2)]
    assert chats[0].usage.prompt_tokens_details.cached_tokens < chats[1].usage.prompt_tokens_details.cached_tokens
    assert chats[1].usage.prompt_tokens_details.cached_tokens == (chats[1].usage.prompt_tokens - 1) // 16 * 16
    response = client.responses.create(model="test-model", input=prompt + " (responses)", max_output_tokens=16)
    response = client.responses.create(model="test-model", input=prompt + " (responses)", max_output_tokens=16)
    assert response.usage.input_tokens_details.cached_tokens == (response.usage.input_tokens - 1) // 16 * 16
