"""Speculative decoding through the server (`speculative` on chat and completions, the spec_decode metrics)
and the CLI (`--speculative`): the same answer as without drafts, and one clear error for a bad value."""
import pytest

from serving import http_json, reference, tiny_server  # noqa: F401  (fixtures)
from test_cli import run

PROMPT = "abcabcabcabc abcabc abc"   # repeated text: prompt lookup has something to find


def test_completions_and_chat_with_drafts_equal_without(tiny_server, reference):
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    _, before = http_json("GET", tiny_server.url + "/metrics")
    status, drafted = http_json("POST", tiny_server.url + "/v1/completions",
                                {**body, "speculative": {"method": "ngram", "k": 4}})
    assert status == 200, drafted
    assert drafted["choices"][0]["text"] == reference.generate(PROMPT, max_new_tokens=24, temperature=0).text
    messages = [{"role": "user", "content": PROMPT}]
    status, chat = http_json("POST", tiny_server.url + "/v1/chat/completions",
                             {"model": "test-model", "messages": messages, "max_tokens": 16, "temperature": 0,
                              "speculative": {"method": "ngram", "num_speculative_tokens": 2,
                                              "prompt_lookup_max": 4}})
    assert status == 200, chat
    assert chat["choices"][0]["message"]["content"] == reference.chat(messages, max_new_tokens=16,
                                                                      temperature=0).content
    _, metrics = http_json("GET", tiny_server.url + "/metrics")
    count = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
             if line.startswith("npqwen:spec_decode_")}
    print(count)
    assert count["npqwen:spec_decode_num_draft_tokens_total"] > 0
    assert 0 <= count["npqwen:spec_decode_num_accepted_tokens_total"] <= count["npqwen:spec_decode_num_draft_tokens_total"]


@pytest.mark.parametrize("speculative, says", [({"method": "eagle"}, "speculative"), ({"method": "ngram", "k": 0}, "k"),
                                               ({"method": "ngram", "k": 2, "num_speculative_tokens": 2}, "not both"),
                                               ({"method": "mtp"}, "no multi-token-prediction head")])
def test_a_bad_speculative_is_a_400(tiny_server, speculative, says):
    status, body = http_json("POST", tiny_server.url + "/v1/completions",
                             {"model": "test-model", "prompt": "Hi", "max_tokens": 4, "speculative": speculative})
    assert status == 400 and says in body["error"]["message"], body


def test_chat_says_which_tokens_were_drafted_and_kept(tiny_server, reference):
    """A chat with drafts carries, per token (streamed: per chunk, beside its token_ids), the draft verified at
    its place and whether the token is that draft, kept: what the page marks (docs/web-page.md)."""
    from test_web_page import sse

    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": "test-model", "messages": messages, "max_tokens": 24, "temperature": 0, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}, "speculative": {"method": "ngram", "k": 3}}
    status, whole = http_json("POST", tiny_server.url + "/v1/chat/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["token_ids"] == reference.generate(reference.chat_prompt(messages, enable_thinking=False),
                                                     max_new_tokens=24, temperature=0).token_ids
    marks = choice["speculative"]
    assert len(marks) == len(choice["token_ids"])
    assert all(m["accepted"] == (m["draft"] == t) for m, t in zip(marks, choice["token_ids"]))
    kept = sum(m["accepted"] for m in marks)
    print(f"{len(marks)} tokens, {sum(m['draft'] is not None for m in marks)} drafted, {kept} kept")
    assert kept > 0
    chunks = sse(tiny_server.url + "/v1/chat/completions", {**body, "stream": True})
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert all(len(c["speculative"]) == len(c["token_ids"]) for c in streamed)
    assert sum((c["speculative"] for c in streamed), []) == marks
    status, plain = http_json("POST", tiny_server.url + "/v1/chat/completions", {**body, "speculative": None})
    assert "speculative" not in plain["choices"][0]


def test_cli_speculative():
    args = ("generate", "--model", "tiny", "--prompt", PROMPT, "--raw", "-t", "0", "-n", "16")
    code, plain, _ = run(*args)
    assert code == 0
    for option in ("ngram:3", '{"method": "ngram", "k": 2}'):
        code, out, err = run(*args, "--speculative", option)
        assert (code, out) == (0, plain), err
    code, _, err = run(*args, "--speculative", "ngram:x")
    assert code == 1 and err.strip().splitlines() == ["npqwen: error: --speculative: K must be a whole number, got "
                                                      "'x' (write METHOD:K, e.g. ngram:4)"], err
