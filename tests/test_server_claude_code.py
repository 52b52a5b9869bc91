"""Claude Code 2.1.197 against npqwen: the requests it really sends, recorded (tests/data/claude_code:
`claude -p` reading a file, once with a model name it does not know as Claude and once with a Claude
name: the HEAD / it starts with, its main turn and its turn with the tool_result), replayed: each is a
200 with a well-formed stream. Then (real client, skipped where it is not installed) `claude -p ...
--output-format json` against the server ends with exit 0 and is_error false, with both names.

The model is claude_code.py's checkpoint that answers "ok", inside the engine without its layer
(Layerless) so that the ~20,000-token prompt costs nothing; NPQWEN_CLAUDE_SERVE=1 also runs the real
client against `npqwen serve` itself over the checkpoint with its layer (10 minutes for both names on
a busy 2-core machine: the layer's attention reads the whole prompt; Claude Code is given
docs/messages.md's settings for a slow first turn).
"""
import http.client
import json
import os
import subprocess
import sys
import urllib.request
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402

from claude_code import PATIENT, QUIET, VERSION, Layerless, claude_binary, recorded, write_ok_model  # noqa: E402
from conftest import QWEN3_TOKENIZER_DIR  # noqa: E402
from serving import LiveServer  # noqa: E402

SESSIONS = ("served name test-model", "Claude name claude-sonnet-4-5-20250929")
NAMES = {SESSIONS[0]: "test-model", SESSIONS[1]: "claude-sonnet-4-5-20250929"}


@pytest.fixture(scope="module")
def ok_model(tmp_path_factory):
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"Qwen3's tokenizer is not in {QWEN3_TOKENIZER_DIR} (tools/fetch_qwen3_tokenizer.sh)")
    return write_ok_model(tmp_path_factory.mktemp("ok-model"), QWEN3_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def servers(ok_model):
    """One live server per session's name, over the "ok" model without its layer."""
    live = {}
    llm = npqwen.load(str(ok_model))
    llm.model = Layerless(llm.model)
    for session, name in NAMES.items():   # the same model (it keeps nothing) under two names, an engine each
        live[session] = LiveServer(llm, model_name=name, engine=Engine(llm, kv_cache_tokens=65536, page_size=16,
                                                                       max_batched_tokens=8192))
    yield live
    for server in live.values():
        server.close()


def events_of(raw: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; the name must be the data's type."""
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        name, data = name.removeprefix("event: "), json.loads(data.removeprefix("data: "))
        assert name == data["type"], block
        events.append((name, data))
    return events


def well_formed(events: list[tuple[str, dict]]) -> str:
    """Anthropic's order: message_start, pings, each block started / grown / stopped, message_delta,
    message_stop. Returns the text."""
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    open_index, text = None, ""
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            text += data["delta"].get("text", "")
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    return text


def test_recorded_claude_code_sessions_replay(servers):
    """Every request of both recorded sessions is answered 200: HEAD / (its check that the server is
    there), and each /v1/messages call with a well-formed stream whose text is the model's "ok"; the
    one with a model name Claude Code does not know carries system messages among its messages (a 400
    before npqwen read them)."""
    requests = recorded()
    assert {r["session"] for r in requests} == set(SESSIONS)
    assert any(m["role"] == "system" for r in requests if r["session"] == SESSIONS[0] and "body" in r
               for m in r["body"]["messages"])
    assert any(b.get("type") == "tool_result" for r in requests if "body" in r for m in r["body"]["messages"]
               if isinstance(m["content"], list) for b in m["content"])
    for r in requests:
        server = servers[r["session"]]
        target = urlparse(server.url)
        if "body" not in r:
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            conn.request(r["method"], r["path"], headers=r["headers"])
            response = conn.getresponse()
            assert response.status == 200 and response.read() == b"", (r["method"], r["path"])
            conn.close()
            continue
        request = urllib.request.Request(server.url + r["path"], data=json.dumps(r["body"]).encode(),
                                         headers=r["headers"], method=r["method"])
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
            events = events_of(response.read().decode())
        assert well_formed(events) == "ok", events
        assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
    for server in servers.values():
        assert not server.errors, [e.getMessage() for e in server.errors]


def claude(url: str, name: str, cwd) -> dict:
    """`claude -p` with Claude Code pointed at `url` alone, telemetry and updates off; its JSON result."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), **QUIET, **PATIENT,
           "ANTHROPIC_BASE_URL": url,
           "ANTHROPIC_MODEL": name, "ANTHROPIC_DEFAULT_HAIKU_MODEL": name, "ANTHROPIC_DEFAULT_SONNET_MODEL": name,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": name, "ANTHROPIC_SMALL_FAST_MODEL": name}
    done = subprocess.run([claude_binary(), "-p", "Say ok.", "--output-format", "json"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout)


def check_client():
    binary = claude_binary()
    if binary is None:
        pytest.skip(f"Claude Code is not installed (npm install --prefix .cache/claude-code "
                    f"@anthropic-ai/claude-code@{VERSION}, or NPQWEN_CLAUDE=path)")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout
    print(f"\nClaude Code: {version.strip()}")


def test_claude_code_turn_completes(servers, tmp_path):
    """(real client) `claude -p` ends with exit 0, is_error false and the model's text, with the served
    name as it comes and with a Claude name."""
    check_client()
    for session, name in NAMES.items():
        result = claude(servers[session].url, name, tmp_path)
        assert result["is_error"] is False and result["result"] == "ok", result
        assert list(result["modelUsage"]) == [name], result
    for server in servers.values():
        assert not server.errors, [e.getMessage() for e in server.errors]


@pytest.mark.skipif(os.environ.get("NPQWEN_CLAUDE_SERVE") != "1",
                    reason="about 5 minutes a name: NPQWEN_CLAUDE_SERVE=1 runs it (with Claude Code installed)")
def test_claude_code_against_npqwen_serve(ok_model, tmp_path):
    """(real client) The same against `npqwen serve` itself, the model's layer included."""
    check_client()
    for name in NAMES.values():
        serve = subprocess.Popen([sys.executable, "-m", "npqwen", "serve", "--model", str(ok_model), "--port", "0",
                                  "--served-model-name", name, "--log-level", "warning", "--max-batched-tokens",
                                  "8192"], stdout=subprocess.PIPE, text=True)
        try:
            line = serve.stdout.readline()
            while "serving" not in line:
                assert line, "npqwen serve ended before it served"
                line = serve.stdout.readline()
            url = line.split(" at ")[1].split("/v1")[0]
            result = claude(url, name, tmp_path)
            assert result["is_error"] is False and result["result"] == "ok", result
        finally:
            serve.terminate()
            serve.wait(30)
