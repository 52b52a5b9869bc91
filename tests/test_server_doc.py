"""docs/server.md, docs/messages.md and docs/web-page.md against a live `npqwen serve`.

The test starts the page's `npqwen serve` line with the built-in tiny model in place of
Qwen/Qwen3-0.6B (random weights: the samples check shapes and constraints, never the text) on a free
port in place of 8000, then runs each page's ```python samples, in order, as one script, and
server.md's other ```bash lines (curl) against it. Blocks shown and not run (```console): server.md's
`pip install` (the network) and its lm-evaluation-harness command (tests/test_eval_harness.py runs
it against a live server, comparing every loglikelihood with HF's); web-page.md's screenshot command,
which rewrites docs/images on purpose (tests/test_web_page.py drives the page itself).
"""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ROOT, doc_samples, run_doc_line, run_doc_python

pytest.importorskip("fastapi")
pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """(the port, the names the samples swap) of `npqwen serve` started from server.md's line."""
    port = free_port()
    swap = {"Qwen/Qwen3-0.6B": "tiny", "127.0.0.1:8000": f"127.0.0.1:{port}"}
    shell = doc_samples("server.md", shown=("console",), swap=swap)[1]
    line = next(line for line in shell if line.startswith("npqwen serve"))
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    server = subprocess.Popen(f"exec {line} --port {port}", shell=True, cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, server.stdout.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                break
        except OSError:
            assert time.monotonic() < deadline, "npqwen serve did not answer /health in 120 s"
            time.sleep(0.2)
    yield port, swap
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def test_server_doc_samples_run(served, tmp_path):
    port, swap = served
    python, shell = doc_samples("server.md", shown=("console",), swap=swap)
    assert len(python) >= 4
    run_doc_python(python, tmp_path / "server_doc.py")
    curls = [line for line in shell if not line.startswith("npqwen serve")]
    assert curls and all(line.startswith("curl ") for line in curls)
    for line in curls:
        assert run_doc_line(line).stdout


def test_messages_doc_samples_run(served, tmp_path):
    """docs/messages.md: the anthropic SDK and curl against the same server (its Claude Code lines are
    shown, and so are the lines quoted from Claude Code's own code)."""
    pytest.importorskip("anthropic")
    python, shell = doc_samples("messages.md", shown=("console", "text"), swap=served[1])
    assert len(python) >= 3 and len(shell) == 1 and shell[0].startswith("curl ")
    run_doc_python(python, tmp_path / "messages_doc.py")
    assert '"type":"message"' in run_doc_line(shell[0]).stdout


def test_web_page_doc_samples_run(served, tmp_path):
    python, shell = doc_samples("web-page.md", shown=("console",), swap=served[1])
    assert len(python) >= 1 and not shell
    run_doc_python(python, tmp_path / "web_page_doc.py")
