"""/openapi.json and /docs say what the server really answers (400s, OpenAI's error shape,
text/event-stream), schemathesis finds no 5xx and no response off the schema, and browsers on
other origins may call the API when --allowed-origins lets them (CORS, preflight OPTIONS)."""
import http.client
import json
import subprocess
import sys
from urllib.parse import urlparse

import pytest

pytest.importorskip("fastapi")

import npqwen  # noqa: E402
from npqwen import Engine  # noqa: E402
from npqwen.tiny import IM_END, tiny_tokenizer  # noqa: E402

from conftest import tiny_config, write_npqwen_checkpoint  # noqa: E402
from serving import LiveServer, http_json  # noqa: E402

CHECKS = "all"   # every check of schemathesis, positive_data_acceptance included
# What no schema can state: a prompt or an input longer than the (96-token) context once tokenized (and
# the chat template and tools applied), min_tokens over the room left, a Responses input item that is
# no message, a tool_choice naming a tool not offered (the name must be among the tools' names; both
# APIs run as a chat), a position past the tokens sent. On these routes a schema-valid body may get a
# 400 for such a reason; everywhere else positive_data_acceptance expects it to be served. (best_of
# other than n, a block in a Messages role that cannot hold it, a Responses input of no items: the
# schema says them, test_the_schema_refuses_what_the_handlers_refuse.)
RUNTIME_LIMITS = """
[[operations]]
include-path-regex = "^/(v1/(chat/completions|completions|responses|messages.*|embeddings|npqwen/.*)|tokenize)$"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "404", "429"]
"""


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A random model with a context of 96 tokens: whatever the fuzzer asks, an answer is short."""
    path = write_npqwen_checkpoint(tmp_path_factory.mktemp("small-context"), tiny_config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, max_position_embeddings=96, eos_token_id=IM_END))
    llm = npqwen.load(path)
    llm.tokenizer = tiny_tokenizer()
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=4096, page_size=16), api_key="k")
    yield server
    server.close()


def request(server, method: str, path: str, headers: dict) -> http.client.HTTPResponse:
    target = urlparse(server.url)
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def test_openapi_json_and_docs(small_server):
    status, schema = http_json("GET", small_server.url + "/openapi.json")   # open without the key, as /docs
    assert status == 200 and schema["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"} <= set(schema["paths"])
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "401", "404", "413", "429", "503"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/Error"
    model = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]   # optional: the one served
    assert model["anyOf"] == [{"type": "string", "enum": ["test-model"]}, {"type": "null"}]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "401" not in schema["paths"]["/health"]["get"]["responses"]
    # bounds in JSON Schema's words (before: pydantic's ge / le on 18 optional integers) and the handlers' limits
    assert '"ge"' not in text and '"le"' not in text
    components = schema["components"]["schemas"]
    max_tokens = components["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert max_tokens == {"type": "integer", "minimum": 1}
    assert components["RerankRequest"]["properties"]["documents"]["minItems"] == 1
    vocab = small_server.llm.config.vocab_size
    assert components["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    assert {"type": "string", "minLength": 1} in components["CompletionRequest"]["properties"]["prompt"]["oneOf"]
    docs = request(small_server, "GET", "/docs", {})
    assert docs.status == 200 and docs.getheader("content-type").startswith("text/html")


def test_detokenize_takes_no_tokens_as_its_schema_says(small_server):
    """vLLM's /detokenize takes any list of ids (DetokenizeRequest.tokens: list[int]) and decodes [] to "":
    so does npqwen, and its schema says so (before: minItems 1 in the schema, yet [] answered 200)."""
    key = {"Authorization": "Bearer k"}
    tokens = http_json("GET", small_server.url + "/openapi.json")[1]["components"]["schemas"]["DetokenizeRequest"][
        "properties"]["tokens"]
    status, body = http_json("POST", small_server.url + "/detokenize", {"tokens": []}, key)
    print("schema:", tokens, "answer to []:", status, body)
    assert "minItems" not in tokens and (status, body) == (200, {"prompt": ""})
    status, body = http_json("POST", small_server.url + "/detokenize", {"tokens": [72, 105]}, key)
    assert (status, body) == (200, {"prompt": "Hi"})


def test_the_schema_refuses_what_the_handlers_refuse(small_server):
    """Each limit a handler checks that JSON Schema can state is in /openapi.json: best_of other than n,
    a tool_result in an assistant message (and each role's other blocks), an image block, a server
    tool, `thread`, a Responses input of no items. Each refused body is refused by both, and its
    near twin accepted by both (before: the schema took the refused ones)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = http_json("GET", small_server.url + "/openapi.json")[1]

    def valid(component: str, body: dict) -> bool:
        validator = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/" + component,
                                                     "components": schema["components"]})
        return validator.is_valid(body)

    user, key = {"role": "user", "content": "hi"}, {"Authorization": "Bearer k"}
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    tool = {"name": "f", "input_schema": {"type": "object"}}
    message = {"model": "test-model", "max_tokens": 2}
    cases = [   # (path, component, refused body, served body)
        ("/v1/completions", "CompletionRequest", {"prompt": "a", "max_tokens": 1, "n": 2, "best_of": 3},
         {"prompt": "a", "max_tokens": 1, "n": 2, "best_of": 2}),
        ("/v1/completions", "CompletionRequest", {"prompt": "a", "max_tokens": 1, "best_of": 2},
         {"prompt": "a", "max_tokens": 1, "best_of": 1}),
        ("/v1/messages", "MessagesRequest",
         {**message, "messages": [user, {"role": "assistant", "content": [result]}]},
         {**message, "messages": [user, {"role": "assistant", "content": [call]}, {"role": "user", "content": [
             result]}]}),
        ("/v1/messages", "MessagesRequest", {**message, "messages": [{"role": "user", "content": [call]}]},
         {**message, "messages": [user]}),
        ("/v1/messages", "MessagesRequest", {**message, "messages": [user, {"role": "system", "content": [
            {"type": "thinking", "thinking": "x"}]}]}, {**message, "messages": [user, {"role": "system", "content": [
                {"type": "text", "text": "x"}]}]}),
        ("/v1/messages", "MessagesRequest", {**message, "messages": [{"role": "user", "content": [image]}]},
         {**message, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}),
        ("/v1/messages", "MessagesRequest", {**message, "messages": [user], "tools": [
            {"type": "web_search_20250305", "name": "web_search"}]}, {**message, "messages": [user], "tools": [tool],
                                                                       "tool_choice": {"type": "none"}}),
        ("/v1/messages", "MessagesRequest", {**message, "messages": [user], "thread": {"type": "create"}},
         {**message, "messages": [user], "thread": None}),
        ("/v1/responses", "ResponsesRequest", {"input": [], "max_output_tokens": 2},
         {"input": [user], "max_output_tokens": 2}),
    ]
    for path, component, refused, served in cases:
        status, answer = http_json("POST", small_server.url + path, refused, key)
        assert status == 400 and not valid(component, refused), (path, refused, status, answer)
        status, answer = http_json("POST", small_server.url + path, served, key)
        assert status == 200 and valid(component, served), (path, served, status, answer)


def test_schemathesis_finds_no_server_error_and_nothing_off_the_schema(small_server, tmp_path, capsys):
    """A bounded run (10 examples an operation, 30 s) of every operation, with the key, and every check.
    Before: pydantic's ge / le hid 18 bounds, and 11 schema-valid bodies got a 400."""
    pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")
    report = tmp_path / "report.json"
    (tmp_path / "schemathesis.toml").write_text(RUNTIME_LIMITS)
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", small_server.url + "/openapi.json",
                          "--checks", CHECKS, "--phases", "examples,coverage,fuzzing", "--max-examples", "10",
                          "--max-time", "30", "--workers", "1", "--request-timeout", "30", "--seed", "1",
                          "--header", "Authorization: Bearer k", "--report", "json", "--report-json-path",
                          str(report)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    summary = run.stdout[run.stdout.find("SUMMARY"):]
    with capsys.disabled():
        print("\nschemathesis: " + " ".join(line.strip() for line in summary.splitlines()
                                             if "generated" in line or "Tested" in line or "Skipped" in line
                                             or line.strip().startswith("-")))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "failed" not in summary.split("Test cases:")[-1].split("\n")[1], summary
    assert not small_server.errors, [r.getMessage() for r in small_server.errors]


def test_cors_is_off_by_default(small_server):
    preflight = request(small_server, "OPTIONS", "/v1/chat/completions", {
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert preflight.getheader("access-control-allow-origin") is None


def test_allowed_origins_answer_preflight_and_requests():
    llm = npqwen.load("tiny")
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=1024, page_size=16), api_key="k",
                        allowed_origins=["http://app.example"])
    try:
        preflight = request(server, "OPTIONS", "/v1/chat/completions", {   # a browser's, without the key
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status == 200, preflight.getheaders()
        assert preflight.getheader("access-control-allow-origin") == "http://app.example"
        assert "POST" in preflight.getheader("access-control-allow-methods")
        assert "authorization" in preflight.getheader("access-control-allow-headers").lower()
        answer = request(server, "GET", "/v1/models", {"Origin": "http://app.example", "Authorization": "Bearer k"})
        assert answer.status == 200 and answer.getheader("access-control-allow-origin") == "http://app.example"
        other = request(server, "OPTIONS", "/v1/chat/completions", {
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert other.status == 400 and other.getheader("access-control-allow-origin") is None
    finally:
        server.close()


def test_serve_allowed_origins_on_the_command_line():
    from test_server_cli import start, stop

    proc, url = start("--allowed-origins", "http://a.example, http://b.example", "--log-level", "warning")
    try:
        target = urlparse(url)
        for origin, allowed in (("http://b.example", True), ("http://c.example", False)):
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            conn.request("OPTIONS", "/v1/completions", headers={"Origin": origin,
                                                                "Access-Control-Request-Method": "POST"})
            response = conn.getresponse()
            response.read()
            conn.close()
            assert (response.getheader("access-control-allow-origin") == origin) == allowed, response.getheaders()
    finally:
        code, err = stop(proc)
    assert code == 0 and "Traceback" not in err, err[-2000:]
