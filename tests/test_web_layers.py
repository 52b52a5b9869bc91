"""The token inspector's "layers" view: POST /v1/npqwen/layers (one token's probability and rank under each
layer's logit lens) equals llm.logit_lens, runs its pass on the engine thread (a probe), refuses bad input;
the page draws it for the clicked token. The same for the "saliency" view: POST /v1/npqwen/saliency (gradient x
input of one token's log-probability for each token before it) equals npqwen.attribution.gradient_x_input, and
the page shades the tokens by it (in this file, to share its server and browser)."""
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import npqwen  # noqa: E402
from npqwen import attribution, grad  # noqa: E402

from serving import http_json, tiny_server  # noqa: E402,F401  (fixtures)
from tolerance import model_tolerance  # noqa: E402
from test_web_page import (WIDE, ask, browser, click_token, console_errors, open_page, page_answer,  # noqa: E402,F401
                           screenshot, wait)

# each layer's lens probability (at most 1) from the server's probe against a second copy of tiny reading the
# prompt whole (the same sums, blocked otherwise; under 64 tokens): within its float32 bar
LENS_TOL = model_tolerance(npqwen.load("tiny").config, 64)


def lens_of(ids, p):
    """(probabilities, ranks) of token p under each layer's lens at p - 1, from a second copy of the tiny model."""
    lens = npqwen.load("tiny").logit_lens(ids[:p + 1])
    return lens.next_probs[:, p - 1], lens.next_ranks[:, p - 1]


def test_layers_endpoint_equals_the_logit_lens_and_runs_on_the_engine_thread(tiny_server):
    ids = tiny_server.llm.tokenizer.encode("<|im_start|>user\nWhich layer?<|im_end|>\n")
    model, threads = tiny_server.engine.model, []
    forward = model.forward_batch

    def watched(batch, kv, recorder=None):
        if recorder is not None:
            threads.append(threading.current_thread().name)
        return forward(batch, kv, recorder)
    model.forward_batch = watched
    try:
        for position in (3, None):
            body = {"tokens": ids} if position is None else {"tokens": ids, "position": position}
            status, got = http_json("POST", tiny_server.url + "/v1/npqwen/layers", body)
            assert status == 200, got
            p = len(ids) - 1 if position is None else position
            probs, ranks = lens_of(ids, p)
            assert got["position"] == p and [x["layer"] for x in got["layers"]] == [0, 1]
            assert np.abs(np.array([x["probability"] for x in got["layers"]]) - probs).max() <= LENS_TOL
            assert [x["rank"] for x in got["layers"]] == ranks.tolist()
    finally:
        del model.forward_batch
    assert threads == ["npqwen-engine"] * 2, threads


@pytest.mark.parametrize("body, param, words", [
    ({"tokens": [65, 66], "position": 0}, "position", "position 0 is not predicted"),
    ({"tokens": []}, "tokens", "send 1 .. 2048"),
    ({"tokens": [65, 100000]}, "tokens", "token id 100000"),
])
def test_layers_endpoint_refuses(tiny_server, body, param, words):
    status, error = http_json("POST", tiny_server.url + "/v1/npqwen/layers", body)
    assert status == 400, error
    assert error["error"]["param"] == param and words in error["error"]["message"], error


def shown_layers(browser) -> list:
    return browser.execute_script("""return [...document.querySelectorAll('#layers li')].map(li =>
        [Number(li.dataset.layer), Number(li.dataset.probability), Number(li.dataset.rank)]);""")


def test_page_shows_each_layer_s_lens_of_the_token(browser, tiny_server, screenshot):
    open_page(browser, tiny_server)
    answer = ask(browser, "Layers")
    got = page_answer(browser)
    for index in (0, 2):
        click_token(browser, answer, index)
        ids = got["prompt_ids"] + got["ids"][:index + 1]
        probs, ranks = lens_of(ids, len(ids) - 1)
        wait(browser, lambda: len(shown_layers(browser)) == 2 and
             [r for _, _, r in shown_layers(browser)] == ranks.tolist() and
             np.abs(np.array([p for _, p, _ in shown_layers(browser)]) - probs).max() <= LENS_TOL,
             what=f"the layers of token {index}")
    browser.execute_script("document.getElementById('layers-view').scrollIntoView()")
    screenshot("layers.png", WIDE)
    assert not console_errors(browser)


# -- saliency --

TWIN = npqwen.load("tiny")   # a second copy of the server's model: the same weights, the same float32 sums


def saliency_of(ids, p) -> np.ndarray:
    return attribution.gradient_x_input(TWIN, ids[:p], grad.log_prob(ids[p])).per_token


def test_saliency_endpoint_equals_gradient_x_input_and_runs_on_the_engine_thread(tiny_server):
    ids = tiny_server.llm.tokenizer.encode("<|im_start|>user\nWhich tokens?<|im_end|>\n")
    wants = {p: saliency_of(ids, p) for p in (3, len(ids) - 1)}   # before the watch: the server's calls only
    threads, gradients = [], grad.gradients

    def watched(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return gradients(*args, **kwargs)
    grad.gradients = watched
    try:
        for position in (3, None):
            body = {"tokens": ids} if position is None else {"tokens": ids, "position": position}
            status, got = http_json("POST", tiny_server.url + "/v1/npqwen/saliency", body)
            assert status == 200, got
            p = len(ids) - 1 if position is None else position
            want = wants[p]
            diff = np.abs(np.array(got["scores"]) - want).max()
            print(f"position {p}: {len(want)} scores, max |server - gradient_x_input| {diff:.2e}")
            assert got["position"] == p and len(got["tokens"]) == p == len(got["token_bytes"])
            assert diff <= 1e-6 * max(1.0, np.abs(want).max())   # the same model and sums: equal, or all but
    finally:
        grad.gradients = gradients
    assert threads == ["npqwen-engine"] * 2, threads


@pytest.mark.parametrize("body, param, words", [
    ({"tokens": [65, 66], "position": 0}, "position", "position 0 is not predicted"),
    ({"tokens": []}, "tokens", "send 1 .. 2048"),
    ({"tokens": [65, 100000]}, "tokens", "token id 100000"),
])
def test_saliency_endpoint_refuses(tiny_server, body, param, words):
    status, error = http_json("POST", tiny_server.url + "/v1/npqwen/saliency", body)
    assert status == 400, error
    assert error["error"]["param"] == param and words in error["error"]["message"], error


def test_page_shades_the_tokens_before_the_clicked_one_by_their_saliency(browser, tiny_server, screenshot):
    open_page(browser, tiny_server)
    answer = ask(browser, "Saliency")
    got = page_answer(browser)
    click_token(browser, answer, 1)
    ids = got["prompt_ids"] + got["ids"][:2]
    want = saliency_of(ids, len(ids) - 1)

    def shown():
        return browser.execute_script("""const v = document.getElementById('saliency');
            if (v.dataset.state !== 'ready') return [];
            return [...v.querySelectorAll('.sal')].map(s => Number(s.dataset.score));""")
    wait(browser, lambda: len(shown()) == len(want), what="the saliency of token 1")
    assert np.abs(np.array(shown()) - want).max() <= 1e-6 * max(1.0, np.abs(want).max())
    browser.execute_script("document.getElementById('saliency-view').scrollIntoView()")
    screenshot("saliency.png", WIDE)
    assert not console_errors(browser)
