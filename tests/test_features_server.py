"""feature_edits through the server (chat, completions, Responses) and the CLI (generate, chat): the same tokens as
llm.generate with the same edits, an edited request batched with one that is not; feature labels from a
Neuronpedia export (`npqwen features --labels`, the server's --feature-labels); the page's features view
(POST /v1/npqwen/features against llm.run_with_saes, and the DOM). On the built-in tiny model (D=16)."""
import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")

import npqwen  # noqa: E402
from npqwen.checkpoint import save_safetensors  # noqa: E402

from serving import LiveServer, http_json  # noqa: E402
from test_web_page import ask, browser, click_token, console_errors, open_page, page_answer, wait  # noqa: E402,F401,F811

PROMPT = "The cat sat on"
F, K = 64, 4
# Neuronpedia's explanation export: a JSON array of explanations, index as a string (its API's
# /api/explanation/export and the bulk export's batch files carry the same fields)
LABELS = [{"modelId": "tiny", "layer": "1-res-demo", "index": str(f), "description": f" feature {f} words ",
           "explanationModelName": "none", "typeName": "oai_token-act-pair"} for f in range(0, F, 2)]


@pytest.fixture(scope="module")
def sae_folder(tmp_path_factory):
    """A random TopK SAE on block 1's output of the tiny model, in SAELens's layout, and its labels file."""
    folder = tmp_path_factory.mktemp("features") / "demo"
    folder.mkdir()
    rng, D = np.random.default_rng(0), 16
    save_safetensors(folder / "sae_weights.safetensors", {
        "W_enc": rng.standard_normal((D, F)).astype(np.float32), "W_dec": rng.standard_normal((F, D)).astype(
            np.float32), "b_enc": np.zeros(F, np.float32), "b_dec": np.zeros(D, np.float32)})
    (folder / "cfg.json").write_text(json.dumps({"architecture": "topk", "k": K,
                                                 "hook_name": "blocks.1.hook_resid_post"}))
    (folder.parent / "labels.json").write_text(json.dumps(LABELS))
    return folder


@pytest.fixture(scope="module")
def llm():
    return npqwen.load("tiny")


@pytest.fixture(scope="module")
def sae(llm, sae_folder):
    return npqwen.load_sae(sae_folder, llm.config)


@pytest.fixture(scope="module")
def edit(llm, sae):
    """A clamp of the prompt's last token's strongest feature, strong enough to change the greedy tokens."""
    _, (run,) = llm.run_with_saes(PROMPT, sae, top=1)
    return {"sae": sae, "feature": int(run.indices[-1, 0]), "clamp": 30.0}


@pytest.fixture(scope="module")
def server(sae, sae_folder):
    from npqwen.features import load_labels

    llm = npqwen.load("tiny")
    server = LiveServer(llm, engine=npqwen.Engine(llm, kv_cache_tokens=4096, page_size=16),
                        saes={"demo": sae}, labels={"demo": load_labels(sae_folder.parent / "labels.json")})
    yield server
    server.close()


def wire(edit):
    return [{"sae": "demo", "feature": edit["feature"], "clamp": edit["clamp"]}]


def test_completions_with_feature_edits_beside_a_plain_request(server, llm, edit):
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    seen, forward = [], server.engine.model.forward_batch

    def watched(batch, kv, recorder=None):   # which steps ran an edited and a plain request together
        seen.append((len(batch.lengths), bool(batch.feature_edits)))
        time.sleep(0.03)   # steps long enough that the second request arrives while the first runs
        return forward(batch, kv, recorder)
    server.engine.model.forward_batch = watched
    answers = {}

    def post(name, extra):
        answers[name] = http_json("POST", server.url + "/v1/completions", {**body, **extra})
    try:
        threads = [threading.Thread(target=post, args=a) for a in (("edited", {"feature_edits": wire(edit)}),
                                                                   ("plain", {}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        del server.engine.model.forward_batch
    (status, edited), (status2, plain) = answers["edited"], answers["plain"]
    assert status == status2 == 200, (edited, plain)
    want = llm.generate(PROMPT, max_new_tokens=12, temperature=0, feature_edits=[edit]).token_ids
    alone = llm.generate(PROMPT, max_new_tokens=12, temperature=0).token_ids
    print(f"edited {edited['choices'][0]['token_ids']}\nwant   {want}\nplain  {plain['choices'][0]['token_ids']}\n"
          f"alone  {alone}\nsteps (sequences, edited) {seen}")
    assert edited["choices"][0]["token_ids"] == want != alone
    assert plain["choices"][0]["token_ids"] == alone
    assert (2, True) in seen   # the two ran in one batch


def test_chat_and_responses_take_feature_edits(server, llm, edit):
    messages = [{"role": "user", "content": "Hi"}]
    want = llm.chat(messages, max_new_tokens=8, temperature=0, feature_edits=[edit]).content
    status, chat = http_json("POST", server.url + "/v1/chat/completions",
                             {"model": "test-model", "messages": messages, "max_tokens": 8, "temperature": 0,
                              "feature_edits": wire(edit)})
    assert status == 200 and chat["choices"][0]["message"]["content"] == want, chat
    status, resp = http_json("POST", server.url + "/v1/responses",
                             {"model": "test-model", "input": "Hi", "max_output_tokens": 8, "temperature": 0,
                              "feature_edits": wire(edit)})
    assert status == 200, resp
    assert [p["text"] for item in resp["output"] if item["type"] == "message" for p in item["content"]] == [want]


@pytest.mark.parametrize("item, says", [
    ({"sae": "other", "feature": 1, "clamp": 1.0}, "feature_edits[0].sae 'other' is not an SAE this server loaded"),
    ({"sae": "demo", "feature": F, "clamp": 1.0}, f"feature_edits[0].feature must be a feature from 0 to {F - 1}"),
    ({"sae": "demo", "feature": 1}, "exactly one of clamp"),
    ({"sae": "demo", "feature": 1, "zero": False}, "feature_edits[0].zero must be true"),
])
def test_bad_feature_edits_are_a_400_naming_the_field(server, item, says):
    status, error = http_json("POST", server.url + "/v1/completions",
                              {"model": "test-model", "prompt": "a", "max_tokens": 2, "feature_edits": [item]})
    assert status == 400 and error["error"]["param"] == "feature_edits" and says in error["error"]["message"], error


def test_features_endpoint_equals_run_with_saes(server, llm, sae):
    ids = llm.tokenizer.encode(PROMPT)
    status, got = http_json("POST", server.url + "/v1/npqwen/features", {"tokens": ids, "position": 2, "top": 3})
    assert status == 200, got
    _, (run,) = llm.run_with_saes(ids, sae, top=3)
    assert (got["saes"], got["sae"], got["position"], got["num_features"]) == (["demo"], "demo", 2, F)
    assert [f["feature"] for f in got["features"]] == [int(i) for i, v in zip(run.indices[2], run.values[2]) if v > 0]
    for f in got["features"]:
        assert np.allclose(f["activations"], run.acts[:, f["feature"]], rtol=1e-6, atol=1e-6)
        assert f["activation"] == pytest.approx(run.acts[2, f["feature"]], rel=1e-6)
        assert f["label"] == (f"feature {f['feature']} words" if f["feature"] % 2 == 0 else None)
    assert got["tokens"] == [llm.tokenizer.decode([i]) for i in ids]
    status, error = http_json("POST", server.url + "/v1/npqwen/features", {"tokens": ids, "sae": "nope"})
    assert status == 400 and error["error"]["param"] == "sae", error


def test_cli_generate_takes_feature_edits(sae_folder, llm, edit, capsys):
    from npqwen.cli import main

    common = ["generate", "-m", "tiny", "--raw", "-p", PROMPT, "-n", "12", "--temperature", "0"]
    assert main([*common, "--sae", str(sae_folder), "--clamp-feature", f"{edit['feature']}=30"]) == 0
    want = llm.generate(PROMPT, max_new_tokens=12, temperature=0, feature_edits=[edit]).text
    assert capsys.readouterr().out == want + "\n"
    for options, says in [(["--clamp-feature", "3=30"], "need --sae PATH"),
                          (["--sae", str(sae_folder), "--scale-feature", "3"], "--scale-feature takes FEATURE=VALUE"),
                          (["--sae", str(sae_folder), "--zero-feature", str(F)], "the feature edit.feature must be")]:
        assert main([*common, *options]) == 1
        err = capsys.readouterr().err
        assert err.startswith("npqwen: error: ") and says in err and "Traceback" not in err, err


def test_the_features_command_shows_labels(sae_folder, llm, sae, capsys):
    from npqwen.cli import main

    assert main(["features", "-m", "tiny", "-p", "ab", "--sae", str(sae_folder), "--labels",
                 str(sae_folder.parent / "labels.json"), "--top-k", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    _, (run,) = llm.run_with_saes("ab", sae, top=2)
    shown = sorted({int(i) for i, v in zip(run.indices.ravel(), run.values.ravel()) if v > 0})
    assert out[4:] == [f"{i:>8}  feature {i} words" for i in shown if i % 2 == 0], out
    bad = sae_folder.parent / "bad.json"
    bad.write_text('[{"index": "1"}]')
    assert main(["features", "-m", "tiny", "-p", "ab", "--sae", str(sae_folder), "--labels", str(bad)]) == 1
    assert 'has no "index" and "description"' in capsys.readouterr().err


def shown_features(browser) -> list:
    return browser.execute_script("""return [...document.querySelectorAll('#features li')].map(li =>
        [Number(li.dataset.feature), Number(li.dataset.activation),
         (li.querySelector('.label') || {}).textContent || null]);""")


def test_page_shows_the_token_s_features_and_where_one_fires(browser, server, llm, sae):
    open_page(browser, server)
    answer = ask(browser, "Features", max_tokens=6)
    got = page_answer(browser)
    ids = got["prompt_ids"] + got["ids"]
    _, (run,) = llm.run_with_saes(ids, sae, top=8)
    p = len(got["prompt_ids"]) + 1   # the answer's second token
    click_token(browser, answer, 1)
    want = [(int(i), float(v), f"feature {i} words" if i % 2 == 0 else None)
            for i, v in zip(run.indices[p], run.values[p]) if v > 0]
    wait(browser, lambda: [f for f, _, _ in shown_features(browser)] == [f for f, _, _ in want],
         what="the token's features")
    for (f, a, label), (f2, a2, label2) in zip(shown_features(browser), want):
        assert abs(a - a2) <= 1e-5 * max(1, abs(a2)) and label == label2
    browser.find_element("css selector", "#features li .feature").click()
    wait(browser, lambda: len(browser.find_elements("css selector", "#feature-tokens .heat")) == len(ids),
         what="where the feature fires")
    shade = browser.execute_script("""return [...document.querySelectorAll('#feature-tokens .heat')].map(s =>
        Number(s.dataset.activation));""")
    assert np.allclose(shade, run.acts[:, want[0][0]], rtol=1e-5, atol=1e-6)
    assert not console_errors(browser)
