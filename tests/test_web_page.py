"""The web page of `npqwen serve` (GET /), driven in a real headless Chromium through Selenium, and
the two API pieces it stands on: return_token_ids and POST /v1/npqwen/attention.

A real server on 127.0.0.1 serves the built-in tiny model (meaningless text, real distributions and
attention) or a scripted model where the exact text matters; the scripted server's attention
endpoint still runs the tiny model's real weights over the scripted text. The browser tests skip
only when no Chromium and chromedriver are installed (CI installs Debian's). The screenshots go
to each test's temporary folder; `python -m pytest tests/test_web_page.py --screenshots docs/images`
regenerates the ones docs/web-page.md and the README show.
"""
import json
import math
import os
import shutil
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402
from npqwen.trace import Trace  # noqa: E402

from conftest import ROOT  # noqa: E402
from tolerance import model_tolerance  # noqa: E402
from serving import LiveServer, ScriptedModel, SlowModel, http_json, reference, tiny_server  # noqa: E402,F401  (fixtures)

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
THINK_OFF = "<think>\n\n</think>\n\n"
WIDE = (1700, 900)   # a window wide enough for the inspector beside the chat, covering none of it
UNSAFE = ('Here: <script>window.pwned = "script"</script> and <img src=x onerror="window.pwned = \'img\'"> and '
          '[a trap](javascript:window.pwned=\'link\') and [the docs](https://example.com/docs?a=1&b=2) and '
          '<a href="javascript:window.pwned=1">raw</a>.\n\n```html\n<script>window.pwned = "code"</script>\n```')
SCRIPT = {   # the first trigger found in the prompt wins: a later turn's trigger comes first
    "Q-SHOW": "<think>\nA list, some code and a link will show what the page renders.\n</think>\n\n"
              "Three ways to **add** numbers in Python:\n\n1. the `+` operator\n2. `sum()` over a list\n"
              "3. `math.fsum` for floats\n\n```python\nprint(sum([1, 2, 3]))\n```\n\n"
              "See [the Python docs](https://docs.python.org/3/library/functions.html#sum).",
    "Q-THINK": "<think>\nThe user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**.",
    "Q-PARIS": THINK_OFF + "The capital of France is Paris.",
    "Q-LONG": THINK_OFF + "A very long answer. " * 150,
    "Q-UNSAFE": THINK_OFF + UNSAFE,
    "Q-PHONE": THINK_OFF + "A long line of code:\n\n```\n" + "x = 1; " * 40 + "\n```\n\nand a long word: " + "a" * 120,
    "Q-CAFE": THINK_OFF + "Un café, merci.",    # é is two byte tokens in the tiny model: \xc3 \xa9
    "Q-WIDE": THINK_OFF + "Tokens to click on. " * 10,
}

# A probe reads the prompt in chunks, then its last token alone; against one forward pass of a tiny model (2 layers)
# that is the same sums blocked otherwise: the probabilities and weights it shows (at most 1, prompts under 64
# tokens) within the model's float32 bar.
PROBE_TOL = model_tolerance(npqwen.load("tiny").config, 64)


# -- servers --


@pytest.fixture(scope="module")
def scripted_server():
    """The engine answers from SCRIPT, a step every 10 ms (slow enough to press Stop); the real tiny
    weights run underneath (the attention endpoint reads them)."""
    llm = npqwen.load("tiny")
    llm.model = SlowModel(ScriptedModel(llm.model, llm.tokenizer, SCRIPT, eos_id=llm.eos_token_ids[0]), 0.01)
    engine = Engine(llm, kv_cache_tokens=8192, page_size=16, prefix_cache=False)
    server = LiveServer(llm, engine=engine)
    yield server
    server.close()


def user(content):
    return [{"role": "user", "content": content}]


def sse(url: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed call, read with urllib."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        lines = response.read().decode().split("\n\n")
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# -- the API: return_token_ids --

def test_return_token_ids_chat_and_completions(tiny_server, reference):
    body = dict(model="test-model", messages=user("What is a page table?"), temperature=0, max_tokens=12,
                chat_template_kwargs={"enable_thinking": False}, return_token_ids=True)
    status, whole = http_json("POST", tiny_server.url + "/v1/chat/completions", body)
    assert status == 200, whole
    prompt = reference.chat_prompt(user("What is a page table?"), enable_thinking=False)
    expected = reference.generate(prompt, max_new_tokens=12, temperature=0)
    assert whole["prompt_token_ids"] == reference.tokenizer.encode(prompt)
    assert whole["choices"][0]["token_ids"] == expected.token_ids
    # streamed: prompt ids on the first chunk only; each chunk's ids join to the whole answer's
    chunks = sse(tiny_server.url + "/v1/chat/completions", {**body, "stream": True, "logprobs": True})
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == whole["choices"][0]["token_ids"]
    for c in chunks:   # a chunk's ids are the tokens of its logprobs
        choice = c["choices"][0]
        assert [e["token"] for e in choice["logprobs"]["content"]] == \
            [reference.tokenizer.decode([t]) for t in choice["token_ids"]]
    # without it, no ids
    status, plain = http_json("POST", tiny_server.url + "/v1/chat/completions", {**body, "return_token_ids": False})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    # completions: each choice carries its prompt's ids; streamed, on its first chunk
    body = dict(model="test-model", prompt="The sky is", temperature=0, max_tokens=8, return_token_ids=True)
    status, whole = http_json("POST", tiny_server.url + "/v1/completions", body)
    assert whole["choices"][0]["prompt_token_ids"] == reference.tokenizer.encode("The sky is")
    assert whole["choices"][0]["token_ids"] == reference.generate("The sky is", 8, temperature=0).token_ids
    chunks = sse(tiny_server.url + "/v1/completions", {**body, "stream": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == whole["choices"][0]["token_ids"]
    # strict: a bool, nothing else
    status, error = http_json("POST", tiny_server.url + "/v1/completions", {**body, "return_token_ids": 1})
    assert status == 400 and error["error"]["param"] == "return_token_ids", error


# -- the API: /v1/npqwen/attention --

def test_attention_endpoint_equals_trace_and_runs_on_the_engine_thread(tiny_server, reference):
    ids = reference.tokenizer.encode("<|im_start|>user\nWhere is Paris?<|im_end|>\n")
    trace = Trace()
    reference.forward(ids, recorder=trace)
    threads = []
    model = tiny_server.engine.model
    forward = model.forward_batch

    def watched(batch, kv, recorder=None):   # the passes with a recorder: each probe's last token
        if recorder is not None:
            threads.append(threading.current_thread().name)
        return forward(batch, kv, recorder)
    model.forward_batch = watched
    try:
        for layer, position in ((0, 5), (1, len(ids) - 1), (1, 0)):
            status, got = http_json("POST", tiny_server.url + "/v1/npqwen/attention",
                                    {"tokens": ids, "position": position, "layer": layer})
            assert status == 200, got
            probs = trace[f"model.layers.{layer}.self_attn.attn_probs"]          # (H, T, T)
            want = probs[:, position, :position + 1]                             # (H, position + 1)
            diff = np.abs(np.array(got["heads"]) - want).max()
            assert diff <= PROBE_TOL, f"layer {layer} position {position}: max difference {diff}"
            assert np.abs(np.array(got["mean"]) - want.mean(axis=0)).max() <= PROBE_TOL
            assert got["tokens"] == [reference.tokenizer.decode([t]) for t in ids[:position + 1]]
            assert got["token_bytes"] == [list(reference.tokenizer.token_bytes(t)) for t in ids[:position + 1]]
            assert (got["layer"], got["position"], got["num_layers"], got["num_heads"]) == \
                (layer, position, reference.config.num_hidden_layers, reference.config.num_attention_heads)
        status, last = http_json("POST", tiny_server.url + "/v1/npqwen/attention", {"tokens": ids, "layer": 0})
        assert last["position"] == len(ids) - 1           # the default: the last token
    finally:
        del model.forward_batch
    assert threads == ["npqwen-engine"] * 4, threads


@pytest.mark.parametrize("body, param, words", [
    ({"tokens": [], "layer": 0}, "tokens", "send 1 .. 2048"),
    ({"tokens": [65] * 2049, "layer": 0}, "tokens", "2049 ids"),
    ({"tokens": [65, 66], "layer": 2}, "layer", "layers 0 .. 1"),
    ({"tokens": [65, 66], "layer": -1}, "layer", "layer -1"),
    ({"tokens": [65, 66], "layer": 0, "position": 2}, "position", "0 .. 1"),
    ({"tokens": [65, 66], "layer": 0, "position": -1}, "position", "position -1"),
    ({"tokens": [65, 100000], "layer": 0}, "tokens", "token id 100000"),
    ({"tokens": [65, -3], "layer": 0}, "tokens", "token id -3"),
    ({"tokens": ["A"], "layer": 0}, "tokens[0]", ""),
    ({"tokens": [65], "layer": 0, "heads": [1]}, "heads", "unsupported field"),
    ({"tokens": [65], "layer": 0, "model": "other"}, "model", "does not exist"),
])
def test_attention_endpoint_refuses(tiny_server, body, param, words):
    status, error = http_json("POST", tiny_server.url + "/v1/npqwen/attention", body)
    assert status in (400, 404), error
    assert error["error"]["param"] == param and words in error["error"]["message"], error


# -- the browser --

@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    binary = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium and chromedriver on this machine (apt-get install chromium chromium-driver)")
    os.environ.setdefault("SE_OFFLINE", "true")   # Selenium Manager must not try to download a browser
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    yield chrome
    chrome.quit()


def wait(browser, condition, timeout=20, what="the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(
        lambda d: condition(), f"{what} did not happen within {timeout} s")


def open_page(browser, server, size=(1280, 900)):
    browser.set_window_size(*size)
    browser.get(server.url + "/")
    browser.get_log("browser")   # start each test with an empty console log
    wait(browser, lambda: browser.execute_script("return window.npqwen && window.npqwen.model"), what="/v1/models")


def ask(browser, text, temperature=0, thinking=False, max_tokens=24, alternatives=5, wait_done=True, paste=False):
    """Fill Settings (max_tokens None: leave the field as it is), type `text` (or paste it: set the
    box's value, for a long text), press Send; the answer's element (after it finished, if wait_done)."""
    browser.execute_script("""
        const [t, thinking, max, alts] = arguments;
        document.getElementById('temperature').value = t;
        document.getElementById('thinking').checked = thinking;
        if (max !== null) document.getElementById('max-tokens').value = max;
        document.getElementById('top-logprobs').value = alts;""", temperature, thinking, max_tokens, alternatives)
    n = len(browser.find_elements("css selector", ".msg.assistant"))
    if paste:
        browser.execute_script("document.getElementById('prompt').value = arguments[0]", text)
    else:
        browser.find_element("id", "prompt").send_keys(text)
    browser.find_element("id", "send").click()
    wait(browser, lambda: len(browser.find_elements("css selector", ".msg.assistant")) > n)
    answer = browser.find_elements("css selector", ".msg.assistant")[-1]
    if wait_done:
        wait(browser, lambda: answer.get_attribute("data-state") != "streaming", what="the end of the answer")
        assert answer.get_attribute("data-state") == "done", answer.text
    return answer


def page_answer(browser, index=-1) -> dict:
    return browser.execute_script("""const a = window.npqwen.answers.at(arguments[0]);
        return {content: a.content, reasoning: a.reasoningSoFar, prompt_ids: a.promptIds,
                ids: a.generated.map(t => t.id)};""", index)


def click_token(browser, answer, index):
    if answer.find_element("css selector", ".tokens").is_displayed() is False:
        answer.find_element("css selector", ".tokens-toggle").click()
    answer.find_element("css selector", f'.tok[data-index="{index}"]').click()


def box(browser, element) -> dict:
    """The element's place in the window (getBoundingClientRect)."""
    return browser.execute_script("const r = arguments[0].getBoundingClientRect();"
                                  "return {x: r.x, y: r.y, width: r.width, height: r.height, top: r.top,"
                                  "        bottom: r.bottom, left: r.left, right: r.right};", element)


def under_pointer(browser, element) -> bool:
    """Is `element` what a pointer at its centre would touch (not covered by anything)?"""
    return browser.execute_script("const e = arguments[0], r = e.getBoundingClientRect();"
                                  "return document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2) === e;",
                                  element)


@pytest.fixture(scope="module", autouse=True)
def images_untouched(request):
    """A test run leaves the tracked screenshots alone unless asked to write them (--screenshots)."""
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in IMAGES.glob("*")}
    yield
    if request.config.getoption("screenshots") is None:
        after = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in IMAGES.glob("*")}
        assert after == before, f"the tests wrote into {IMAGES}: {set(after.items()) ^ set(before.items())}"


@pytest.fixture
def screenshot(browser, request, tmp_path):
    """save(name, size): a screenshot of the page (the window resized to `size` first, if given) into
    --screenshots DIR if given, else the test's tmp_path."""
    folder = Path(request.config.getoption("screenshots") or tmp_path)

    def save(name, size=None):
        if size is not None:   # and the pointer off the page's tokens, which moved under it
            from selenium.webdriver import ActionChains

            browser.set_window_size(*size)
            ActionChains(browser).move_to_element(browser.find_element("tag name", "h1")).perform()
        folder.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(folder / name)), name
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return save


def console_errors(browser) -> list:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_page_chat_streams_the_api_answer_and_keeps_the_conversation(browser, tiny_server):
    open_page(browser, tiny_server)
    client = tiny_server.client()
    kwargs = dict(model="test-model", temperature=0, max_tokens=24,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True})
    answer = ask(browser, "What is a page table?")
    api = client.chat.completions.create(messages=user("What is a page table?"), **kwargs)
    got = page_answer(browser)
    assert got["content"] == api.choices[0].message.content, (got["content"], api.choices[0].message.content)
    assert got["ids"] == api.choices[0].model_extra["token_ids"]
    assert got["prompt_ids"] == api.model_extra["prompt_token_ids"]
    stats = answer.find_element("css selector", ".stats").text
    assert "first token" in stats and "tokens/s" in stats and f"{len(got['ids'])} tokens" in stats, stats
    # the second turn sends the first back (its answer's text, no reasoning)
    ask(browser, "And a page?")
    first = api.choices[0].message.content
    messages = user("What is a page table?") + [{"role": "assistant", "content": first}] + user("And a page?")
    api2 = client.chat.completions.create(messages=messages, **kwargs)
    assert page_answer(browser)["content"] == api2.choices[0].message.content
    assert page_answer(browser)["prompt_ids"] == api2.model_extra["prompt_token_ids"]
    # New chat forgets it
    browser.find_element("id", "new-chat").click()
    assert browser.execute_script("return window.npqwen.history.length") == 0
    assert not browser.find_elements("css selector", ".msg")
    assert console_errors(browser) == []


def test_page_token_alternatives_match_api_logprobs(browser, tiny_server, screenshot):
    open_page(browser, tiny_server)
    call = dict(model="test-model", messages=user("Name a colour."), temperature=0, max_tokens=16, logprobs=True,
                top_logprobs=6, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the page's request and the API's below both find the prompt's first 32 tokens in the prefix cache:
    # one that computed all 39 in its first step would differ from them in float32 rounding (1e-7)
    tiny_server.client().chat.completions.create(**call)
    answer = ask(browser, "Name a colour.", max_tokens=16, alternatives=6)
    api = tiny_server.client().chat.completions.create(**call)
    content = api.choices[0].logprobs.content
    assert not answer.find_element("css selector", ".tokens").is_displayed()   # until asked for
    for index in (0, len(content) // 2, len(content) - 1):
        click_token(browser, answer, index)
        rows = browser.find_elements("css selector", "#alternatives li")
        shown = [(r.get_attribute("data-token"), float(r.get_attribute("data-prob"))) for r in rows]
        want = [(t.token, math.exp(t.logprob)) for t in content[index].top_logprobs]
        assert [s[0] for s in shown] == [w[0] for w in want], (index, shown, want)
        # the same float64 log-probability, exponentiated by the page (JavaScript) and here: float64 rounding only
        assert np.allclose([s[1] for s in shown], [w[1] for w in want], rtol=1e-9, atol=0), (index, shown, want)
        assert "selected" in answer.find_element("css selector", f'.tok[data-index="{index}"]').get_attribute("class")
    screenshot("alternatives.png", WIDE)
    assert console_errors(browser) == []


def heatmap(browser, layer, head):
    """Choose layer and head in the inspector; the weights the page shows, by position."""
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "layer")).select_by_value(str(layer))
    wait(browser, lambda: browser.execute_script(
        "const h = document.getElementById('heatmap');"
        "return h.dataset.state === 'ready' && h.dataset.layer == arguments[0]", layer),
        what=f"the attention of layer {layer}")
    Select(browser.find_element("id", "head")).select_by_value(str(head))
    spans = browser.find_elements("css selector", "#heatmap .heat[data-position]")
    assert [int(s.get_attribute("data-position")) for s in spans] == list(range(len(spans)))
    return np.array([float(s.get_attribute("data-weight")) for s in spans])


def test_page_attention_view_matches_trace(browser, scripted_server, reference, screenshot):
    open_page(browser, scripted_server)
    answer = ask(browser, "Q-PARIS: what is the capital of France?", max_tokens=64)
    got = page_answer(browser)
    assert got["content"] == "The capital of France is Paris."
    index = got["content"].index("Paris")   # byte-level tokens: one per character here
    click_token(browser, answer, index)
    wait(browser, lambda: browser.find_element("id", "heatmap").get_attribute("data-state") == "ready")
    # the step that chose the token read everything before it; its query is the token before
    ids = got["prompt_ids"] + got["ids"][:index]
    trace = Trace()
    reference.forward(ids, recorder=trace)
    for layer, head in ((1, 2), (0, 0)):
        probs = trace[f"model.layers.{layer}.self_attn.attn_probs"][:, -1, :]      # (H, T)
        shown = heatmap(browser, layer, head)
        assert np.abs(shown - probs[head]).max() <= PROBE_TOL, (layer, head, shown[:5], probs[head][:5])
        shown = heatmap(browser, layer, "mean")
        assert np.abs(shown - probs.mean(axis=0)).max() <= PROBE_TOL, (layer, shown[:5], probs.mean(axis=0)[:5])
    texts = [s.text for s in browser.find_elements("css selector", "#heatmap .heat[data-position]")]
    assert "".join(texts[-len("The capital of France is "):]) == "The capital of France is "
    assert browser.find_element("css selector", "#heatmap .heat.next").text == "P"
    heatmap(browser, 1, 1)
    screenshot("attention.png", WIDE)
    assert console_errors(browser) == []


def test_page_shows_byte_tokens_one_way_everywhere(browser, scripted_server, reference):
    """A token that is one byte of a UTF-8 character reads \\xNN in the token view, the alternatives,
    the chosen token and the heatmap (prompt and answer alike), never U+FFFD."""
    open_page(browser, scripted_server)
    answer = ask(browser, "Q-CAFE: un café?", max_tokens=64)
    assert page_answer(browser)["content"] == "Un café, merci."
    answer.find_element("css selector", ".tokens-toggle").click()
    view = [t.text for t in answer.find_elements("css selector", ".tok")]
    assert view[:9] == ["U", "n", " ", "c", "a", "f", "\\xc3", "\\xa9", ","], view
    click_token(browser, answer, 6)
    assert browser.find_element("css selector", "#chosen code").text == "\\xc3"
    assert browser.find_element("css selector", "#alternatives li.chosen code").text == "\\xc3"
    click_token(browser, answer, 8)   # the step after the é: the heatmap holds both of the prompt's and the answer's
    wait(browser, lambda: browser.find_element("id", "heatmap").get_attribute("data-state") == "ready")
    heat = [s.text for s in browser.find_elements("css selector", "#heatmap .heat[data-position]")]
    assert not any("\ufffd" in t for t in heat), heat
    assert heat[-8:] == view[:8], (heat[-8:], view[:8])      # the answer so far, as the token view shows it
    prompt = "".join(heat[:-8])
    assert "Q-CAFE: un caf\\xc3\\xa9?" in prompt, prompt
    status, got = http_json("POST", scripted_server.url + "/v1/npqwen/attention",
                            {"tokens": reference.tokenizer.encode("café"), "layer": 0})
    assert got["tokens"] == ["c", "a", "f", "\ufffd", "\ufffd"]              # the endpoint sends the bytes too
    assert got["token_bytes"] == [[99], [97], [102], [195], [169]]
    assert console_errors(browser) == []


def test_page_reasoning_is_folded_and_markdown_rendered(browser, scripted_server, screenshot):
    open_page(browser, scripted_server)
    answer = ask(browser, "Q-THINK: what is 2 + 2?", thinking=True, max_tokens=200)
    details = answer.find_element("css selector", "details.reasoning")
    assert details.is_displayed() and details.get_attribute("open") is None
    assert not answer.find_element("css selector", ".reasoning-text").is_displayed()
    assert details.find_element("css selector", "summary").text.startswith("Reasoning")
    details.find_element("css selector", "summary").click()
    assert answer.find_element("css selector", ".reasoning-text").text == "The user asks for 2 + 2. That is 4."
    assert answer.find_element("css selector", ".answer").text == "The answer is 4."
    assert answer.find_element("css selector", ".answer strong").text == "4"
    assert page_answer(browser)["reasoning"].strip() == "The user asks for 2 + 2. That is 4."
    # sent back without the reasoning
    assert browser.execute_script("return window.npqwen.history")[-1] == {"role": "assistant",
                                                                          "content": "The answer is **4**."}
    answer = ask(browser, "Q-SHOW: how do I add numbers?", thinking=True, max_tokens=400)
    assert [li.text for li in answer.find_elements("css selector", ".answer ol li")] == \
        ["the + operator", "sum() over a list", "math.fsum for floats"]
    assert answer.find_element("css selector", ".answer pre code").text == "print(sum([1, 2, 3]))"
    screenshot("chat.png")
    assert console_errors(browser) == []


def test_page_stop_aborts_the_request_on_the_server(browser, scripted_server):
    open_page(browser, scripted_server)
    answer = ask(browser, "Q-LONG: go on", max_tokens=4000, wait_done=False)
    wait(browser, lambda: len(page_answer(browser)["ids"]) >= 5, what="the first tokens")
    assert scripted_server.engine.stats["running"] == 1
    browser.find_element("id", "stop").click()
    wait(browser, lambda: answer.get_attribute("data-state") == "stopped", what="the stop")
    assert scripted_server.wait_idle(timeout=2) < 2
    assert scripted_server.engine.stats["running"] == scripted_server.engine.stats["waiting"] == 0
    metrics = http_json("GET", scripted_server.url + "/metrics")[1]
    assert "npqwen:num_requests_running 0.0" in metrics
    assert 'npqwen:requests_finished_total{finish_reason="abort"}' in metrics
    n = len(page_answer(browser)["content"])
    assert 0 < n < len(SCRIPT["Q-LONG"]) - len(THINK_OFF), n
    assert "stopped" in answer.find_element("css selector", ".stats").text
    assert browser.find_element("id", "send").is_displayed() and not browser.find_element("id", "stop").is_displayed()
    # AbortController's abort shows as no console error; the partial answer is kept for the next turn
    assert browser.execute_script("return window.npqwen.history.at(-1).content.length") == n
    assert console_errors(browser) == []


def test_page_renders_model_html_and_links_as_text(browser, scripted_server):
    open_page(browser, scripted_server)
    answer = ask(browser, "Q-UNSAFE: show me some HTML", max_tokens=600)
    body = answer.find_element("css selector", ".answer")
    assert page_answer(browser)["content"] == UNSAFE
    # the tags are text, not elements; the only link is the https one
    assert body.find_elements("css selector", "script, img, iframe, object, embed") == []
    assert '<script>window.pwned = "script"</script>' in body.text
    assert "<img src=x onerror=" in body.text and "[a trap](javascript:window.pwned='link')" in body.text
    links = body.find_elements("css selector", "a")
    assert [(a.text, a.get_attribute("href"), a.get_attribute("rel")) for a in links] == \
        [("the docs", "https://example.com/docs?a=1&b=2", "noopener noreferrer")]
    assert body.find_element("css selector", "pre code").text == '<script>window.pwned = "code"</script>'
    # nothing ran: no flag, no console message at all from the answer, and the same in the token view
    answer.find_element("css selector", ".tokens-toggle").click()
    assert answer.find_elements("css selector", ".tokens script, .tokens img") == []
    click_token(browser, answer, 10)
    wait(browser, lambda: browser.find_element("id", "heatmap").get_attribute("data-state") == "ready")
    assert browser.execute_script("return window.pwned") is None
    assert browser.get_log("browser") == []


MARKDOWN_TRAPS = [
    "[x](javascript:window.pwned=1)", "[x](JavaScript:window.pwned=1)", "[x]( javascript:window.pwned=1)",
    "[x](java\tscript:window.pwned=1)", "[x](data:text/html,<script>window.pwned=1</script>)", "[x](//evil.example)",
    "[x](/relative)", "[x](vbscript:msgbox)", "**[x](javascript:window.pwned=1)**", "<svg onload=window.pwned=1>",
    "<iframe src=javascript:window.pwned=1>", "![i](https://example.com/i.png)", '<a href="https://example.com">a</a>',
    'https://example.com/"onmouseover="window.pwned=1', "`<b>code</b>`", "> <script>window.pwned=1</script>",
    "1. <img src=x onerror=window.pwned=1>", "# <script>window.pwned=1</script>", "```\n<script>x</script>",
]


def test_markdown_renderer_makes_only_safe_nodes(browser, scripted_server):
    """Markdown.render over known tricks: only its own tags, no attribute but those it sets, and an
    href only ever an http(s) URL."""
    open_page(browser, scripted_server)
    found = browser.execute_script("""
        const out = [];
        for (const text of arguments[0]) {
          const box = document.createElement('div');
          box.append(Markdown.render(text));
          document.body.append(box);   // live in the page, as an answer is
          for (const el of box.querySelectorAll('*')) {
            out.push({text, tag: el.tagName.toLowerCase(), attrs: [...el.attributes].map(a => a.name),
                      href: el.getAttribute('href')});
          }
          box.remove();
        }
        return out;""", MARKDOWN_TRAPS)
    allowed = {"p", "br", "strong", "em", "code", "a", "ul", "ol", "li", "blockquote", "hr", "h3", "h4", "h5", "h6",
               "pre", "div", "span", "button"}
    for node in found:
        assert node["tag"] in allowed, node
        assert set(node["attrs"]) <= {"href", "rel", "target", "class", "type", "start"}, node
        if node["tag"] == "a":
            assert node["href"].startswith(("http://", "https://")), node
    links = [(n["text"], n["href"]) for n in found if n["tag"] == "a"]   # a bare URL ends at a quote
    assert links == [("![i](https://example.com/i.png)", "https://example.com/i.png"),
                     ('<a href="https://example.com">a</a>', "https://example.com/"),
                     ('https://example.com/"onmouseover="window.pwned=1', "https://example.com/")], links
    assert browser.execute_script("return window.pwned") is None
    assert browser.get_log("browser") == []


def test_page_fits_a_phone(browser, scripted_server, screenshot):
    open_page(browser, scripted_server, size=(390, 844))
    assert browser.execute_script("return window.innerWidth") == 390
    answer = ask(browser, "Q-PHONE: long lines", max_tokens=600)
    screenshot("phone.png")

    def width():
        return max(browser.execute_script("return [document.documentElement.scrollWidth, document.body.scrollWidth]"))
    assert width() <= 390, f"the page is {width()} px wide at a phone's 390 px: it scrolls sideways"
    # the inspector opens as a sheet over the bottom of the screen, the clicked token above it
    inspector = browser.find_element("id", "inspector")
    last = len(page_answer(browser)["ids"]) - 1
    for index in (3, last):   # near the top of the answer, and its last token, at the bottom of the screen
        if index == last:
            browser.find_element("id", "inspector-close").click()
            browser.execute_script("arguments[0].scrollIntoView({block: 'end'})",
                                   answer.find_element("css selector", f'.tok[data-index="{index}"]'))
        click_token(browser, answer, index)
        wait(browser, lambda: browser.find_element("id", "heatmap").get_attribute("data-state") == "ready")
        token = box(browser, answer.find_element("css selector", f'.tok[data-index="{index}"]'))
        sheet = box(browser, inspector)
        height = browser.execute_script("return window.innerHeight")
        assert 0 < sheet["top"] < height and sheet["bottom"] <= height + 1, (index, sheet, height)
        assert 0 <= token["top"] and token["bottom"] <= sheet["top"], (index, token, sheet)
    screenshot("phone-inspector.png")
    browser.find_element("id", "settings-toggle").click()
    assert width() <= 390, f"with the inspector and settings open the page is {width()} px wide"


def test_page_inspector_moves_nothing(browser, scripted_server):
    """Opening the inspector leaves the chat where it was: the clicked token stays under the pointer,
    and a token under the panel's usual place sends the panel to the other side."""
    open_page(browser, scripted_server, size=(1280, 900))
    answer = ask(browser, "Q-WIDE: some tokens", max_tokens=400)
    answer.find_element("css selector", ".tokens-toggle").click()
    chat, inspector = browser.find_element("id", "chat"), browser.find_element("id", "inspector")
    spans = answer.find_elements("css selector", ".tok")
    tops = browser.execute_script("return arguments[0].map(s => s.getBoundingClientRect().top)", spans)
    rightmost = spans[max(i for i, top in enumerate(tops) if top == tops[0])]
    assert box(browser, rightmost)["right"] > 1000, box(browser, rightmost)   # the end of the first line
    middle = spans[len([t for t in tops if t == tops[0]]) // 2]
    for span, side in ((spans[2], "right"), (rightmost, "left"), (middle, "right")):
        before = box(browser, chat), box(browser, span)
        if span is rightmost:   # under the open panel: close it first, as a user would
            browser.find_element("id", "inspector-close").click()
        span.click()
        assert "selected" in span.get_attribute("class")
        assert (box(browser, chat), box(browser, span)) == before, "opening the inspector moved the chat"
        assert under_pointer(browser, span), f"the inspector covers the token clicked ({side})"
        assert inspector.is_displayed()
        assert ("left" in inspector.get_attribute("class").split()) == (side == "left"), side
    # on a wide screen the panel sits beside the centred column, covering none of it
    browser.set_window_size(1800, 900)
    spans[2].click()
    panel, column = box(browser, inspector), box(browser, chat)
    assert panel["left"] >= column["right"] and abs(column["left"] - (1800 - column["right"])) < 2, (panel, column)
    assert console_errors(browser) == []


def test_page_default_max_tokens_is_what_fits(browser, scripted_server):
    """Max tokens starts empty, so the server lets an answer run as far as the context has room
    (the tiny model's is 4096 tokens); a refused request's error shows in its card, above the footer."""
    open_page(browser, scripted_server)
    question = "Q-PARIS: " + "a long question " * 150
    ask(browser, question, max_tokens=None, paste=True)
    got = page_answer(browser)
    assert len(got["prompt_ids"]) > 2048 and got["content"] == "The capital of France is Paris.", len(got["prompt_ids"])
    assert browser.find_element("id", "max-tokens").get_attribute("value") == ""
    browser.find_element("id", "new-chat").click()
    context = scripted_server.llm.config.max_position_embeddings
    answer = ask(browser, question, max_tokens=context, paste=True, wait_done=False)
    wait(browser, lambda: answer.get_attribute("data-state") != "streaming", what="the refusal")
    assert answer.get_attribute("data-state") == "error"
    error, footer = answer.find_element("css selector", ".error"), answer.find_element("css selector", ".msg-footer")
    assert "context is 4096 tokens" in error.text and footer.text.startswith("0 tokens"), (error.text, footer.text)
    assert browser.execute_script("return arguments[0].nextElementSibling", error) == footer
    assert box(browser, error)["bottom"] <= box(browser, footer)["top"]
    assert all("400" in e["message"] for e in console_errors(browser))   # the browser logs the refused fetch itself


def test_page_with_an_api_key(browser, reference):
    llm = npqwen.load("tiny")
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=1024, page_size=16), api_key="s3cret")
    try:
        for path in ("/", "/static/app.js", "/static/markdown.js", "/static/style.css"):
            assert http_json("GET", server.url + path)[0] == 200, path
        status, error = http_json("GET", server.url + "/v1/models")
        assert status == 401 and error["error"]["message"].startswith("no API key was sent"), error
        status, error = http_json("GET", server.url + "/v1/models", headers={"Authorization": "Bearer s3cre7"})
        assert status == 401 and error["error"]["message"].startswith("the API key was refused"), error
        assert http_json("GET", server.url + "/static/other.js")[0] == 401   # only the page's own files are open
        browser.set_window_size(1280, 900)
        browser.get(server.url + "/")
        notice = browser.find_element("id", "notice")
        wait(browser, lambda: notice.is_displayed(), what="the API key notice")
        assert "needs an API key" in notice.text, notice.text
        assert browser.find_element("id", "settings").is_displayed()
        browser.find_element("id", "api-key").send_keys("s3cre7\n")      # a wrong key: refused, and it says so
        wait(browser, lambda: "refused" in notice.text, what="the refused-key notice")
        assert notice.text == "The server refused this API key: check it in Settings."
        browser.find_element("id", "api-key").clear()
        browser.find_element("id", "api-key").send_keys("s3cret\n")
        wait(browser, lambda: browser.execute_script("return window.npqwen.model") == "test-model")
        assert not browser.find_element("id", "notice").is_displayed()
        ask(browser, "Hello", max_tokens=4)
        answer = browser.find_elements("css selector", ".msg.assistant")[-1]
        click_token(browser, answer, 1)
        wait(browser, lambda: browser.find_element("id", "heatmap").get_attribute("data-state") == "ready")
        # the page's headers: its own scripts only
        with urllib.request.urlopen(server.url + "/") as response:
            assert "script-src 'self'" in response.headers["Content-Security-Policy"]
    finally:
        server.close()


def test_page_says_a_built_in_models_text_is_meaningless(browser, tiny_server):
    """Served under its own name, a built-in model (random weights) is shown with that warning; others are not."""
    from npqwen.tiny import BUILTIN

    script = (ROOT / "npqwen" / "server" / "static" / "app.js").read_text(encoding="utf-8")
    assert f"const BUILT_IN_MODELS = {json.dumps(list(BUILTIN))};" in script   # the page's list is npqwen's
    llm = npqwen.load("tiny")
    server = LiveServer(llm, model_name="tiny", engine=Engine(llm, kv_cache_tokens=1024, page_size=16))
    try:
        open_page(browser, server)
        assert browser.find_element("id", "model-name").text == "tiny (random weights: its text is meaningless)"
    finally:
        server.close()
    open_page(browser, tiny_server)   # "test-model": a name npqwen does not build in
    assert browser.find_element("id", "model-name").text == "test-model"


def test_page_marks_drafted_and_accepted_tokens(browser, tiny_server):
    """Settings' Drafts (speculative decoding): the answer is the one without drafts, and in the token view each
    token the API says was a kept draft is underlined as one, each that replaced a refused draft as that;
    the footer counts them."""
    open_page(browser, tiny_server)
    browser.execute_script("document.getElementById('drafts').value = 'ngram';"   # (Settings is folded, as in ask)
                           "document.getElementById('draft-k').value = 3;")
    prompt = "abcabcabcabc abcabc abc"
    answer = ask(browser, prompt, max_tokens=24)
    body = dict(model="test-model", messages=user(prompt), temperature=0, max_tokens=24, return_token_ids=True,
                chat_template_kwargs={"enable_thinking": False}, speculative={"method": "ngram", "k": 3})
    api = http_json("POST", tiny_server.url + "/v1/chat/completions", body)[1]["choices"][0]
    assert page_answer(browser)["ids"] == api["token_ids"]
    answer.find_element("css selector", ".tokens-toggle").click()
    spans = answer.find_elements("css selector", ".tok")
    shown = [("draft-accepted" in s.get_attribute("class"), "draft-refused" in s.get_attribute("class"))
             for s in spans]
    want = [(m["accepted"], m["draft"] is not None and not m["accepted"]) for m in api["speculative"]]
    assert shown == want and any(a for a, _ in shown), (shown, want)
    accepted = sum(a for a, _ in want)
    drafted = sum(m["draft"] is not None for m in api["speculative"])
    assert f"{accepted} of {drafted} drafts accepted" in answer.find_element("css selector", ".stats").text
    assert console_errors(browser) == []
