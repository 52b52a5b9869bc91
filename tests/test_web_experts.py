"""Qwen3-MoE on the server and its page: POST /v1/npqwen/experts (the experts a token went to in each
layer) equals a Trace of the same ids, runs on the engine thread (a probe, read a chunk per step),
refuses bad input in OpenAI's error shape; the page's token inspector shows those experts (and
nothing for a dense model)."""
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402
from npqwen.trace import Trace  # noqa: E402

from serving import LiveServer, http_json, tiny_server  # noqa: E402,F401  (fixtures)
from tolerance import model_tolerance  # noqa: E402
from test_web_page import (WIDE, ask, browser, click_token, console_errors, open_page, page_answer,  # noqa: E402,F401
                           screenshot, wait)

# the routing weights (at most 1) the server's probe computed against one forward pass of tiny-moe (the same sums,
# blocked otherwise; prompts under 64 tokens): within its float32 bar
WEIGHT_TOL = model_tolerance(npqwen.load("tiny-moe").config, 64)


@pytest.fixture(scope="module")
def moe_server():
    llm = npqwen.load("tiny-moe")
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=8192, page_size=16, max_batched_tokens=64))
    yield server
    server.close()


def routing(ids) -> Trace:
    """The router's choices for `ids`, from a second copy of the tiny MoE (same seeded weights)."""
    trace = Trace()
    npqwen.load("tiny-moe").forward(ids, recorder=trace)
    return trace


def test_chat_and_completions_on_a_moe_model_equal_generate(moe_server):
    reference = npqwen.load("tiny-moe")
    client = moe_server.client()
    messages = [{"role": "user", "content": "Which experts?"}]
    chat = client.chat.completions.create(model="test-model", messages=messages, temperature=0, max_tokens=20,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                      "return_token_ids": True})
    want = reference.generate(reference.chat_prompt(messages, enable_thinking=False), max_new_tokens=20,
                              temperature=0)
    assert chat.choices[0].model_extra["token_ids"] == want.token_ids and len(want.token_ids) >= 10
    streamed = client.completions.create(model="test-model", prompt="Experts", temperature=0, max_tokens=12,
                                         stream=True)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == reference.generate("Experts", max_new_tokens=12, temperature=0).text


def test_experts_endpoint_equals_trace_and_runs_on_the_engine_thread(moe_server):
    llm = moe_server.llm
    ids = llm.tokenizer.encode("<|im_start|>user\nWhich experts?<|im_end|>\n")
    trace = routing(ids)
    threads = []
    model = moe_server.engine.model
    forward = model.forward_batch

    def watched(batch, kv, recorder=None):   # the passes with a recorder: each probe's last token
        if recorder is not None:
            threads.append(threading.current_thread().name)
        return forward(batch, kv, recorder)
    model.forward_batch = watched
    try:
        for position in (0, 5, None):
            body = {"tokens": ids} if position is None else {"tokens": ids, "position": position}
            status, got = http_json("POST", moe_server.url + "/v1/npqwen/experts", body)
            assert status == 200, got
            p = len(ids) - 1 if position is None else position
            assert (got["position"], got["num_experts"], got["num_experts_per_tok"]) == (p, 8, 2)
            assert got["token"] == llm.tokenizer.decode([ids[p]]) and len(got["layers"]) == 2
            for layer in got["layers"]:
                gate = f"model.layers.{layer['layer']}.mlp.gate"
                assert layer["experts"] == trace[f"{gate}.top_k_index"][p].tolist()
                assert np.abs(np.array(layer["weights"]) - trace[f"{gate}.top_k_weights"][p]).max() <= WEIGHT_TOL
    finally:
        del model.forward_batch
    assert threads == ["npqwen-engine"] * 3, threads


def test_a_dense_model_has_no_experts_and_no_pass_is_run(tiny_server):
    model = tiny_server.engine.model
    model.forward_batch = lambda *a, **k: pytest.fail("a forward pass ran for a dense model")
    try:
        status, got = http_json("POST", tiny_server.url + "/v1/npqwen/experts", {"tokens": [65, 66]})
    finally:
        del model.forward_batch
    assert status == 200 and (got["num_experts"], got["layers"], got["position"]) == (0, [], 1), got


@pytest.mark.parametrize("body, param, words", [
    ({"tokens": []}, "tokens", "send 1 .. 2048"),
    ({"tokens": [65] * 2049}, "tokens", "2049 ids"),
    ({"tokens": [65, 66], "position": 2}, "position", "0 .. 1"),
    ({"tokens": [65, 66], "position": -1}, "position", "position -1"),
    ({"tokens": [65, 100000]}, "tokens", "token id 100000"),
    ({"tokens": ["A"]}, "tokens[0]", ""),
    ({"tokens": [65], "layer": 0}, "layer", "unsupported field"),
    ({"tokens": [65], "model": "other"}, "model", "does not exist"),
])
def test_experts_endpoint_refuses(moe_server, body, param, words):
    status, error = http_json("POST", moe_server.url + "/v1/npqwen/experts", body)
    assert status in (400, 404), error
    assert error["error"]["param"] == param and words in error["error"]["message"], error


def shown_experts(browser) -> list:
    return browser.execute_script("""return [...document.querySelectorAll('#experts li')].map(li =>
        [...li.querySelectorAll('.expert')].map(c => [Number(c.dataset.expert), Number(c.dataset.weight)]));""")


def test_page_shows_the_experts_a_token_went_to(browser, moe_server, tiny_server, screenshot):
    open_page(browser, moe_server)
    answer = ask(browser, "Route this")
    got = page_answer(browser)
    for index in (0, 3):
        click_token(browser, answer, index)
        wait(browser, lambda: not browser.find_element("id", "experts-view").get_property("hidden")
             and browser.find_elements("css selector", "#experts li"), what="the experts view")
        ids = got["prompt_ids"] + got["ids"][:index + 1]     # the token itself is the last position
        trace = routing(ids)
        want = [list(zip(trace[f"model.layers.{i}.mlp.gate.top_k_index"][-1].tolist(),
                         trace[f"model.layers.{i}.mlp.gate.top_k_weights"][-1].tolist())) for i in range(2)]
        wait(browser, lambda: [[e for e, _ in row] for row in shown_experts(browser)] == [[e for e, _ in row]
                                                                                        for row in want],
             what=f"the experts of token {index}")
        weights = np.array([[w for _, w in row] for row in shown_experts(browser)])
        assert np.abs(weights - np.array([[w for _, w in row] for row in want])).max() <= WEIGHT_TOL
    browser.execute_script("document.getElementById('experts-view').scrollIntoView()")
    screenshot("experts.png", WIDE)
    assert not console_errors(browser)
    open_page(browser, tiny_server)                           # a dense model: no experts view
    answer = ask(browser, "Dense")
    click_token(browser, answer, 0)
    wait(browser, lambda: browser.find_element("id", "heatmap").get_attribute("data-state") == "ready")
    assert browser.find_element("id", "experts-view").get_property("hidden")
