"""`npqwen serve` on a Qwen3.5-MoE hybrid model (3 linear-attention layers, 1 full, a shared expert): a chat
completion and a streamed completion whose token ids equal llm.generate's, a JSON-schema constraint, and the web
page's probes (attention of the full-attention layers only, experts, logit lens) equal to the model's own trace.
With Qwen3's tokenizer: there are no Qwen3.5 tokenizer files here."""
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("transformers")

import npqwen  # noqa: E402
from npqwen import Engine, Qwen3Config  # noqa: E402
from npqwen.trace import Trace  # noqa: E402

from conftest import add_qwen3_tokenizer, needs_qwen3_tokenizer  # noqa: E402
from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_moe_config  # noqa: E402
from serving import LiveServer, http_json  # noqa: E402
from tolerance import model_tolerance  # noqa: E402
from test_web_page import (WIDE, ask, browser, click_token, console_errors, open_page, page_answer,  # noqa: E402,F401
                           screenshot, sse, wait)

FULL = [3]   # the full-attention layer of the 4 (every fourth); 0, 1, 2 are linear
# A probe reads the prompt in chunks, its last token then decoding alone (the recurrent form of the delta rule):
# float32 sums in another order than one forward pass over the whole prompt (the chunked form). The values compared
# are probabilities and routing weights (at most 1) of the tiny hybrid MoE model over prompts under 64 tokens.
TOL = model_tolerance(Qwen3Config.from_dict(hybrid_moe_config(vocab_size=151936)), 64)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    needs_qwen3_tokenizer()
    path = build_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_server"),
                                   hybrid_moe_config(vocab_size=151936, eos_token_id=151645), std=0.1)
    return add_qwen3_tokenizer(path)


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    return npqwen.load(hybrid_dir)


@pytest.fixture(scope="module")
def server(hybrid_dir):
    llm = npqwen.load(hybrid_dir)
    live = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=4096, page_size=16, max_batched_tokens=64))
    yield live
    assert [e.getMessage() for e in live.errors] == []
    live.close()


def user(content):
    return [{"role": "user", "content": content}]


def first_mismatch(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def test_chat_and_streamed_completion_equal_generate(server, reference):
    body = dict(model="test-model", messages=user("What is a state matrix?"), temperature=0, max_tokens=12,
                chat_template_kwargs={"enable_thinking": False}, return_token_ids=True)
    status, chat = http_json("POST", server.url + "/v1/chat/completions", body)
    assert status == 200, chat
    prompt = reference.chat_prompt(user("What is a state matrix?"), enable_thinking=False)
    want = reference.generate(prompt, max_new_tokens=12, temperature=0).token_ids
    got = chat["choices"][0]["token_ids"]
    print("chat: server", got, "generate", want, "first mismatch", first_mismatch(got, want))
    assert chat["prompt_token_ids"] == reference.tokenizer.encode(prompt) and got == want
    body = dict(model="test-model", prompt="The state does not grow", temperature=0, max_tokens=10, stream=True,
                return_token_ids=True)
    chunks = sse(server.url + "/v1/completions", body)
    got = sum((c["choices"][0]["token_ids"] for c in chunks), [])
    want = reference.generate("The state does not grow", max_new_tokens=10, temperature=0)
    print("streamed: server", got, "generate", want.token_ids, "first mismatch", first_mismatch(got, want.token_ids))
    assert len(chunks) > 2 and got == want.token_ids
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    server.wait_idle()
    server.engine.check()


def test_a_json_schema_gives_valid_json(server):
    schema = {"type": "object", "properties": {"linear": {"type": "boolean"}, "layers": {"enum": [3, 4, 24]}},
              "required": ["linear", "layers"], "additionalProperties": False}
    body = dict(model="test-model", messages=user("Describe the model as JSON."), temperature=1, seed=5,
                max_tokens=80, chat_template_kwargs={"enable_thinking": False},
                response_format={"type": "json_schema", "json_schema": {"name": "model", "schema": schema}})
    for seed in (5, 6):
        status, got = http_json("POST", server.url + "/v1/chat/completions", {**body, "seed": seed})
        assert status == 200, got
        text = got["choices"][0]["message"]["content"]
        print(f"seed {seed}: {text!r} ({got['choices'][0]['finish_reason']})")
        value = json.loads(text)
        assert set(value) == {"linear", "layers"} and isinstance(value["linear"], bool)
        assert value["layers"] in (3, 4, 24)


def test_attention_probe_shows_the_full_attention_layers_and_refuses_the_linear_ones(server, reference):
    ids = reference.tokenizer.encode("<|im_start|>user\nWhere does the state go?<|im_end|>\n")
    trace = Trace()
    reference.forward(ids, recorder=trace)
    for body in ({"tokens": ids, "layer": 3, "position": 5}, {"tokens": ids}):   # no layer: the first full one
        status, got = http_json("POST", server.url + "/v1/npqwen/attention", body)
        assert status == 200, got
        p = body.get("position", len(ids) - 1)
        want = trace["model.layers.3.self_attn.attn_probs"][:, p, :p + 1]              # (H, p + 1)
        diff = np.abs(np.array(got["heads"]) - want).max()
        print(f"attention of layer 3 at position {p}: max |diff| {diff:.2e}")
        assert diff < TOL and (got["layer"], got["position"], got["attention_layers"]) == (3, p, FULL)
    for layer in (0, 2):
        status, error = http_json("POST", server.url + "/v1/npqwen/attention", {"tokens": ids, "layer": layer})
        assert status == 400 and error["error"]["param"] == "layer", error
        message = error["error"]["message"]
        assert f"layer {layer} is a Gated DeltaNet linear-attention layer" in message and "are [3]" in message, message


def test_experts_and_logit_lens_probes_equal_the_model(server, reference):
    ids = reference.tokenizer.encode("<|im_start|>user\nWhich expert?<|im_end|>\n")
    trace = Trace()
    reference.forward(ids, recorder=trace)
    status, got = http_json("POST", server.url + "/v1/npqwen/experts", {"tokens": ids})
    assert status == 200, got
    for layer in got["layers"]:
        i = layer["layer"]
        assert layer["experts"] == trace[f"model.layers.{i}.mlp.gate.top_k_index"][-1].tolist(), i
        assert np.abs(np.array(layer["weights"]) - trace[f"model.layers.{i}.mlp.gate.top_k_weights"][-1]).max() < TOL
    status, got = http_json("POST", server.url + "/v1/npqwen/layers", {"tokens": ids, "position": 4})
    assert status == 200, got
    lens = reference.logit_lens(ids[:5])
    probs = np.array([x["probability"] for x in got["layers"]])
    print("logit lens of token 4 by layer:", probs, "max |diff|", np.abs(probs - lens.next_probs[:, 3]).max())
    assert np.abs(probs - lens.next_probs[:, 3]).max() < TOL
    assert [x["rank"] for x in got["layers"]] == lens.next_ranks[:, 3].tolist()


def test_the_page_offers_the_full_attention_layers(browser, server, reference, screenshot):
    open_page(browser, server)
    answer = ask(browser, "Say something.", max_tokens=6)
    got = page_answer(browser)
    click_token(browser, answer, 3)
    wait(browser, lambda: browser.find_element("id", "heatmap").get_attribute("data-state") == "ready")
    options = [o.get_attribute("value") for o in browser.find_elements("css selector", "#layer option")]
    assert options == [str(i) for i in FULL], options
    trace = Trace()
    reference.forward(got["prompt_ids"] + got["ids"][:3], recorder=trace)
    want = trace["model.layers.3.self_attn.attn_probs"][:, -1, :].mean(axis=0)
    spans = browser.find_elements("css selector", "#heatmap .heat[data-position]")
    shown = np.array([float(s.get_attribute("data-weight")) for s in spans])
    assert np.abs(shown - want).max() < TOL, (shown[:5], want[:5])
    screenshot("hybrid-attention.png", WIDE)
    assert console_errors(browser) == []


def test_an_all_linear_model_has_no_attention_to_show(tmp_path):
    path = add_qwen3_tokenizer(build_hybrid_checkpoint(tmp_path, hybrid_moe_config(
        vocab_size=151936, num_hidden_layers=2, layer_types=["linear_attention"] * 2), std=0.1))
    llm = npqwen.load(path)
    live = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=256, page_size=16))
    try:
        for body in ({"tokens": [1, 2, 3]}, {"tokens": [1, 2, 3], "layer": 1}):
            status, error = http_json("POST", live.url + "/v1/npqwen/attention", body)
            assert status == 400 and error["error"]["param"] == "layer", error
            assert "Gated DeltaNet linear attention" in error["error"]["message"], error
        assert live.errors == []
    finally:
        live.close()


def test_npqwen_serve_on_a_hybrid_checkpoint(hybrid_dir, reference):
    from test_server_cli import start, stop

    proc, url = start("--model", str(hybrid_dir))   # the last --model wins
    try:
        status, got = http_json("POST", url + "/v1/completions", {"prompt": "The state", "max_tokens": 5,
                                                                  "temperature": 0, "return_token_ids": True})
        assert status == 200, got
        want = reference.generate("The state", max_new_tokens=5, temperature=0).token_ids
        assert got["choices"][0]["token_ids"] == want, (got["choices"][0]["token_ids"], want)
    finally:
        code, err = stop(proc)
    assert code == 0, err[-2000:]
