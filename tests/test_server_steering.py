"""The server's `steering` field on chat, completions and Responses: the same answer as llm.generate with the
same steering; a 400 naming the field for a wrong length, a layer out of range, a value that is not finite."""
import numpy as np
import pytest

from serving import http_json, reference, tiny_server  # noqa: F401  (fixtures)

VECTOR = np.random.default_rng(0).standard_normal(16).round(3).tolist()
STEERING = [{"layer": 1, "vector": VECTOR, "scale": 4.0}]


def test_completions_steered_equal_generate(tiny_server, reference):
    body = {"model": "test-model", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    status, steered = http_json("POST", tiny_server.url + "/v1/completions", {**body, "steering": STEERING})
    assert status == 200, steered
    want = reference.generate("Hello there", max_new_tokens=8, temperature=0, steering=STEERING).text
    plain = reference.generate("Hello there", max_new_tokens=8, temperature=0).text
    print(f"steered {want!r}, plain {plain!r}")
    assert steered["choices"][0]["text"] == want != plain


def test_chat_and_responses_take_steering(tiny_server, reference):
    messages = [{"role": "user", "content": "Hi"}]
    status, chat = http_json("POST", tiny_server.url + "/v1/chat/completions",
                             {"model": "test-model", "messages": messages, "max_tokens": 8, "temperature": 0,
                              "steering": STEERING})
    assert status == 200, chat
    want = reference.chat(messages, max_new_tokens=8, temperature=0, steering=STEERING)
    assert chat["choices"][0]["message"]["content"] == want.content
    status, resp = http_json("POST", tiny_server.url + "/v1/responses",
                             {"model": "test-model", "input": "Hi", "max_output_tokens": 8, "temperature": 0,
                              "steering": STEERING})
    assert status == 200, resp
    texts = [part["text"] for item in resp["output"] if item["type"] == "message" for part in item["content"]]
    assert texts == [want.content]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
@pytest.mark.parametrize("steering, says", [
    ([{"layer": 1, "vector": [1.0, 2.0]}], "steering[0].vector must have 16 values"),
    ([{"layer": 7, "vector": VECTOR}], "steering[0].layer must be a layer from 0 to 1, got 7"),
    ([{"layer": 0, "vector": VECTOR, "scale": float("nan")}], "steering[0].scale must be a finite number"),
    ([{"layer": 0, "vector": [float("inf")] * 16}], "steering[0].vector must hold finite numbers"),
])
def test_bad_steering_is_a_400_naming_the_field(tiny_server, path, steering, says):
    body = {"model": "test-model", "max_tokens": 4, "steering": steering}
    body |= {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
             "/v1/completions": {"prompt": "Hi"},
             "/v1/responses": {"input": "Hi", "max_output_tokens": 4}}[path]
    if path == "/v1/responses":
        del body["max_tokens"]
    status, error = http_json("POST", tiny_server.url + path, body)
    assert status == 400, error
    assert says in error["error"]["message"] and error["error"]["param"] == "steering", error
