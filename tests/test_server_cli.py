"""The real `npqwen serve` command in a subprocess: it prints its URL, serves 32 streaming clients at
once through the engine, gives its memory back, and stops cleanly on Ctrl-C."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import npqwen  # noqa: E402

from conftest import add_qwen3_tokenizer, needs_qwen3_tokenizer, tiny_config, write_npqwen_checkpoint  # noqa: E402
from serving import http_json  # noqa: E402

CLIENTS, REQUESTS_EACH, NEW_TOKENS = 32, 4, 24


def start(*args) -> tuple[subprocess.Popen, str]:
    """`npqwen serve --model tiny --port 0 ARGS`; (process, base URL) once it says it is ready."""
    proc = subprocess.Popen([sys.executable, "-m", "npqwen", "serve", "--model", "tiny", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        pytest.fail(f"npqwen serve did not start: {line!r}\n{proc.stderr.read()}")
    url = line.split(" at ")[1].split("/v1")[0]
    assert url.startswith("http://127.0.0.1:"), line
    return proc, url


def stop(proc: subprocess.Popen, signalled: bool = False) -> tuple[int, str]:
    """Ctrl-C (unless sent already: a second one forces the exit), then the exit code and stderr."""
    if not signalled:
        proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("npqwen serve did not stop within 15 s of Ctrl-C")
    return code, proc.stderr.read()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def wait_idle(url: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        metrics = http_json("GET", url + "/metrics")[1]
        values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("npqwen:num_requests_"))
        if float(values["npqwen:num_requests_running"]) == 0 and float(values["npqwen:num_requests_waiting"]) == 0:
            return
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


async def one_client(client, prompts, expected, report):
    for prompt, want in zip(prompts, expected):
        started, first, text = time.perf_counter(), None, ""
        try:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                                     temperature=0, stream=True)
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - started
                text += "".join(c.text for c in chunk.choices)
        except Exception as e:   # counted as a failure, with its reason
            report["failed"].append(repr(e))
            continue
        report["ttft"].append(first if first is not None else time.perf_counter() - started)
        report["served"] += 1
        if text != want:
            report["wrong"].append((prompt, text, want))


async def load(url: str, prompts_by_client, expected_by_client) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    report = {"served": 0, "failed": [], "wrong": [], "ttft": []}
    started = time.perf_counter()
    await asyncio.gather(*(one_client(client, p, e, report) for p, e in zip(prompts_by_client, expected_by_client)))
    report["seconds"] = time.perf_counter() - started
    await client.close()
    return report


def test_serve_load_32_streaming_clients(capsys):
    proc, url = start("--log-level", "warning", "--max-batch-size", "32", "--served-model-name", "tiny")
    try:
        cold = rss_mb(proc.pid)
        prompts = [[f"Client {c}, request {r}: what is a KV cache?" for r in range(REQUESTS_EACH)]
                   for c in range(CLIENTS)]
        reference = npqwen.load("tiny")
        flat = reference.generate([p for ps in prompts for p in ps], max_new_tokens=NEW_TOKENS, temperature=0)
        expected = [[r.text for r in flat[c * REQUESTS_EACH:(c + 1) * REQUESTS_EACH]] for c in range(CLIENTS)]
        # warm up with one round at the same concurrency, then measure the idle memory
        warm = asyncio.run(load(url, [p[:1] for p in prompts], [e[:1] for e in expected]))
        assert warm["served"] == CLIENTS and not warm["failed"], warm["failed"][:3]
        wait_idle(url)
        idle = rss_mb(proc.pid)

        report = asyncio.run(load(url, prompts, expected))
        wait_idle(url)
        after = rss_mb(proc.pid)
        served, ttft = report["served"], np.array(report["ttft"])
        tokens = served * NEW_TOKENS
        with capsys.disabled():
            print(f"\nload: {CLIENTS} clients x {REQUESTS_EACH} streamed requests of {NEW_TOKENS} tokens: "
                  f"{served} served, {len(report['failed'])} failed, {len(report['wrong'])} wrong, "
                  f"{report['seconds']:.1f} s, {tokens / report['seconds']:.0f} output tok/s; time to first token "
                  f"p50 {np.percentile(ttft, 50) * 1000:.0f} ms, p99 {np.percentile(ttft, 99) * 1000:.0f} ms; "
                  f"RSS cold {cold:.0f} MB, idle after warm-up {idle:.0f} MB, idle after the load {after:.0f} MB")
        assert not report["failed"], report["failed"][:3]
        assert served == CLIENTS * REQUESTS_EACH
        assert not report["wrong"], report["wrong"][:2]
        assert report["seconds"] < 240
        assert after <= idle * 1.05 + 10, f"RSS grew from {idle:.0f} MB to {after:.0f} MB over the load"
        _, metrics = http_json("GET", url + "/metrics")
        finished = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("npqwen:requests_finished_total"))
        assert finished == CLIENTS * (REQUESTS_EACH + 1)
    finally:
        code, err = stop(proc)
    assert code == 0 and "Traceback" not in err, err[-2000:]


def test_serve_stops_cleanly_on_ctrl_c_with_a_stream_open():
    proc, url = start("--api-key", "k")
    assert http_json("GET", url + "/health") == (200, {"status": "ok"})
    # greedy: the tiny model does not write eos in 3000 tokens after "hi", so the stream is still open
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3000,
            "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
    response = urllib.request.urlopen(request, timeout=30)
    assert response.readline().startswith(b"data: ")            # the stream is open
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest = response.read().decode()                              # read on: the server must finish the stream
    code, err = stop(proc, signalled=True)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert time.monotonic() - started < 10
    assert "shutting down" in rest and rest.rstrip().endswith("data: [DONE]"), rest[-500:]


def test_serve_refuses_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "npqwen", "serve", "--model", "tiny", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.count("npqwen: error:") == 1 and "--port" in run.stderr, run.stderr


def children(pid: int) -> list[int]:
    """The pids of a process's children (Linux's /proc/PID/task/*/children)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc")
def test_the_tokenizer_process_ends_with_a_killed_server(tmp_path):
    """kill -9 of `npqwen serve` (as the kernel's OOM killer does) closes nothing: the tokenizer's child
    process, started by a long text, ends with it anyway (before: it lived on). A text over
    LONG_TEXT_CHARS that fits the context needs one longer than tiny's: Qwen3's tokenizer and 40,960."""
    needs_qwen3_tokenizer()
    config = tiny_config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, vocab_size=151936, max_position_embeddings=40960,
                         eos_token_id=151645)
    model = str(add_qwen3_tokenizer(write_npqwen_checkpoint(tmp_path / "qwen3-tokenizer", config)))
    proc, url = start("--model", model)
    try:
        status, count = http_json("POST", url + "/v1/messages/count_tokens", {   # over LONG_TEXT_CHARS
            "model": model, "messages": [{"role": "user", "content": "word " * 14_000}]})
        assert status == 200 and count["input_tokens"] > 14_000, count
        child = [p for p in children(proc.pid) if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(child) == 1, children(proc.pid)
    finally:
        proc.kill()
        proc.wait(15)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{child[0]}") and open(f"/proc/{child[0]}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the tokenizer process outlived the server"
        time.sleep(0.05)
    print(f"\nthe tokenizer process ended {5 - (deadline - time.monotonic()):.2f} s after kill -9 of the server")
