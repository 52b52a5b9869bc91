"""Test helpers for the server: a model whose answers are written in advance, and a real
`npqwen serve` app on 127.0.0.1 run by uvicorn in a thread."""
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import npqwen
from npqwen import Engine


def http_json(method: str, url: str, body=None, headers=None, timeout: float = 30) -> tuple[int, object]:
    """(status, parsed JSON or text) of one plain HTTP request (the standard library's urllib)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def assert_image_refused(url: str):
    """A chat request with an image to a text-only model's server at `url` is a 400 that names image_url."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = dict(model="test-model", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    status, out = http_json("POST", url + "/v1/chat/completions", body)
    print(status, out)
    assert status == 400 and "image_url" in out["error"]["message"]


class ScriptedModel:
    """Stands in for Qwen3 inside the engine: the answer to each prompt is written in advance.

    Like a KV cache keeps keys, it keeps each sequence's token ids in its own page store, so at
    every step it sees the whole sequence (across chunked prefill, the prefix cache and
    preemption). The answer is the first of `answers` whose trigger is in the prompt's text; the
    next token continues that answer's bytes after what the sequence already holds past its last
    "<|im_start|>assistant\\n", then comes eos (and eos again, once the answer is out). An answer may
    start with what the prompt itself ends with (the empty think block of enable_thinking false, a
    forced tool-call start, an assistant message continued).
    The real model runs underneath every batch, so the KV cache holds its keys and values; a
    pass with a recorder (the attention endpoint's) is the real model's alone.
    """

    def __init__(self, real, tokenizer, answers: dict[str, str], eos_id: int):
        self.config, self.dtype, self.xp, self.weights = real.config, real.dtype, real.xp, real.weights
        self.real, self.tokenizer, self.answers, self.eos_id = real, tokenizer, answers, eos_id
        self.assistant = tokenizer.encode("<|im_start|>assistant\n")
        self.store = None    # (pages, page size) token ids

    def forward_batch(self, batch, kv, recorder=None):
        real = self.real.forward_batch(batch, kv, recorder)
        if recorder is not None:
            return real
        if self.store is None:
            self.store = np.zeros((kv.num_pages, kv.page_size), np.int64)
        self.store[batch.write_pages, batch.write_offsets] = batch.token_ids
        ends = np.cumsum(batch.lengths)
        logits = np.array(real.logits, np.float32)   # a row inside a sequence (a prompt being scored) stays real
        for row, r in enumerate(batch.sample_rows):
            seq = int(np.searchsorted(ends - 1, r))
            if r != ends[seq] - 1:
                continue
            n = batch.starts[seq] + batch.lengths[seq]
            pages = np.asarray(batch.page_tables[seq])
            tokens = self.store[pages[np.arange(n) // kv.page_size], np.arange(n) % kv.page_size].tolist()
            logits[row] = -10.0
            logits[row, self.next_token(tokens)] = 10.0
        return real._replace(logits=logits)

    def __getattr__(self, name):   # the rest (forward, what the page's saliency runs) as the real model's
        return getattr(self.real, name)

    def next_token(self, tokens: list[int]) -> int:
        a = len(self.assistant)
        start = max(i + a for i in range(len(tokens) - a + 1) if tokens[i:i + a] == self.assistant)
        prompt = self.tokenizer.decode(tokens[:start])
        answer = next((text for trigger, text in self.answers.items() if trigger in prompt), None)
        assert answer is not None, f"no scripted answer for the prompt {prompt[-200:]!r}"
        written = b"".join(self.tokenizer.token_bytes(t) for t in tokens[start:])
        answer = answer.encode()
        if written.startswith(answer):   # said all (ignore_eos, or min_tokens made it write more): eos again
            return self.eos_id
        assert answer.startswith(written), f"the sequence left its script: {written!r} vs {answer!r}"
        rest = answer[len(written):]
        if not rest:
            return self.eos_id
        try:
            return self.tokenizer.encode(rest.decode())[0]
        except UnicodeDecodeError:   # the rest starts inside a character: the token of its next byte
            return next(t for t in range(self.config.vocab_size) if self.tokenizer.token_bytes(t) == rest[:1])


class SlowModel:
    """The real model with a pause before every step: steps long enough to watch from a test."""

    def __init__(self, real, seconds: float):
        self.real, self.seconds = real, seconds
        self.config, self.dtype, self.xp, self.weights = real.config, real.dtype, real.xp, real.weights

    def forward_batch(self, batch, kv, recorder=None):
        time.sleep(self.seconds)
        return self.real.forward_batch(batch, kv, recorder)

    def __getattr__(self, name):   # the rest (forward, what the page's saliency and features run) as the real model's
        return getattr(self.real, name)


class LiveServer:
    """create_app(...) served by uvicorn on 127.0.0.1 at a free port, in a thread."""

    def __init__(self, llm, model_name: str = "test-model", engine=None, **app_kwargs):
        import uvicorn

        from npqwen.server.api_server import create_app

        self.llm = llm
        self.engine = engine if engine is not None else Engine(llm, kv_cache_tokens=4096, page_size=16)
        step = self.engine.step

        def checked_step():   # the page bookkeeping holds after every step the server runs
            outputs = step()
            self.engine.check()
            return outputs
        self.engine.step = checked_step
        self.app = create_app(llm, self.engine, model_name, **app_kwargs)
        self.loop = self.app.state.loop
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2))
        # what the server logs as an error (an exception in a handler, with its traceback) is kept here
        self.errors: list[logging.LogRecord] = []
        self.log_handler = logging.Handler(logging.ERROR)
        self.log_handler.emit = self.errors.append
        logging.getLogger("uvicorn.error").addHandler(self.log_handler)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                      timeout=kwargs.pop("timeout", 60), **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> float:
        """Seconds until the engine has no request and every page is back (or fail)."""
        started = time.monotonic()
        while self.engine.has_unfinished() or self.loop.commands.qsize():
            assert time.monotonic() - started < timeout, f"still busy: {self.engine.stats}"
            time.sleep(0.005)
        return time.monotonic() - started

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        logging.getLogger("uvicorn.error").removeHandler(self.log_handler)


def tokens_to_end(engine, ids) -> list:
    """Step `engine` until nothing is left, checking its invariants after each step: the tokens of each request in
    `ids`, in that order."""
    tokens = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
        engine.check()
    return [tokens[i] for i in ids]


@pytest.fixture(scope="module")
def tiny_server():
    """A live server over the built-in tiny model (import this fixture into a test module)."""
    llm = npqwen.load("tiny")
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=8192, page_size=16, max_batched_tokens=64))
    yield server
    server.close()


def scripted_server(script: dict, kv_cache_tokens: int = 4096):
    """A live server over the tiny model answering each prompt that contains a key of `script` with its
    text (ScriptedModel), the prefix cache off; yields it, then closes it (a test module's fixture body)."""
    llm = npqwen.load("tiny")
    llm.model = ScriptedModel(llm.model, llm.tokenizer, script, eos_id=llm.eos_token_ids[0])
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=kv_cache_tokens, page_size=16, prefix_cache=False))
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference():
    """A second copy of the tiny model (same seeded weights), for expected values outside the server."""
    return npqwen.load("tiny")


def main(spec: dict):
    """A LiveServer in a process of its own, over a model whose answers are scripted (`answers`) and
    whose steps take `step_seconds` at least (the real weights of `model` run underneath): prints
    its URL, serves until stdin closes. Measurements of stalls use it, so that the test's own
    threads never hold the server's GIL."""
    import sys

    from npqwen.tiny import tiny_tokenizer

    llm = npqwen.load(spec["model"])
    if llm.tokenizer is None:
        llm.tokenizer = tiny_tokenizer()
    eos, real = (llm.eos_token_ids or [llm.tokenizer.token_to_id("<|im_end|>")])[0], llm.model
    llm.model = SlowModel(ScriptedModel(real, llm.tokenizer, spec["answers"], eos_id=eos),
                          spec.get("step_seconds", 0.0))
    engine = Engine(llm, **spec.get("engine", {}))
    llm.model = real   # the engine keeps the scripted one; llm.forward is the real model's
    server = LiveServer(llm, engine=engine)
    print(server.url, flush=True)
    sys.stdin.read()
    server.close()


if __name__ == "__main__":
    import sys

    main(json.loads(sys.argv[1]))
