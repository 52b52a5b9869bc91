"""Thinking that leaves room for the answer, through `npqwen serve` and the openai client: a
structured request with thinking on gets its answer; thinking_token_budget (chat, Responses),
reasoning_effort's budgets, the server's --thinking-budget and --default-chat-template-kwargs;
`npqwen generate --thinking-budget`."""
import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
from pydantic import BaseModel, Field  # noqa: E402

import npqwen  # noqa: E402
from npqwen import NpqwenError  # noqa: E402
from npqwen.cli.serve import template_kwargs_option  # noqa: E402
from npqwen.server.protocol import ChatCompletionRequest  # noqa: E402
from npqwen.server.serving_chat import EFFORT_BUDGETS  # noqa: E402

from serving import LiveServer  # noqa: E402
from test_cli import run  # noqa: E402

USER = [{"role": "user", "content": "Pick a number."}]


class Pick(BaseModel):
    n: int = Field(ge=0, le=99)


@pytest.fixture(scope="module")
def llm():
    return npqwen.load("tiny")


@pytest.fixture(scope="module")
def server(llm):
    server = LiveServer(llm)
    yield server
    server.close()


def close_at(llm, token_ids) -> int:
    """Where "</think>" is in an answer's tokens."""
    return token_ids.index(llm.tokenizer.token_to_id("</think>"))


def test_a_structured_request_with_thinking_on_gets_its_answer(server):
    """Before: the random weights never close their thinking, so .parse() spent max_tokens on reasoning
    and came back with finish_reason "length" and no content. Now the reasoning ends at half of it."""
    r = server.client().chat.completions.parse(model="test-model", messages=USER, response_format=Pick,
                                               max_tokens=48, temperature=0)
    choice = r.choices[0]
    print(f"thinking on, max_tokens 48: finish_reason {choice.finish_reason!r}, "
          f"{r.usage.completion_tokens} tokens, content {choice.message.content!r}")
    assert choice.finish_reason == "stop" and choice.message.parsed.n in range(100)
    assert choice.message.reasoning_content


def test_thinking_token_budget_on_chat_and_responses(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": Pick.model_json_schema()}}
    r = client.chat.completions.create(model="test-model", messages=USER, response_format=fmt, max_tokens=200,
                                       temperature=0, extra_body={"thinking_token_budget": 5, "return_token_ids": True})
    tokens = r.choices[0].message
    assert close_at(server.llm, r.choices[0].token_ids) == 5 + 1   # "<think>", 4 of reasoning, "\n", "</think>"
    assert r.choices[0].finish_reason == "stop" and Pick.model_validate_json(tokens.content)
    resp = client.responses.create(model="test-model", input="Pick a number.", max_output_tokens=200,
                                   temperature=0, extra_body={"thinking_token_budget": 5},
                                   text={"format": {"type": "json_schema", "name": "pick",
                                                    "schema": Pick.model_json_schema()}})
    reasoning = next(item for item in resp.output if item.type == "reasoning").content[0].text
    assert reasoning == tokens.reasoning_content and Pick.model_validate_json(resp.output_text)
    status = client.chat.completions.with_raw_response.create   # a negative budget is a 400 naming the field
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        status(model="test-model", messages=USER, extra_body={"thinking_token_budget": -1})


def test_reasoning_effort_and_the_servers_defaults(llm, server):
    chat = server.app.state.chat
    for effort, budget in EFFORT_BUDGETS.items():
        body = ChatCompletionRequest(model="m", messages=USER, reasoning_effort=effort)
        assert chat.budget(body) == budget and chat.thinking(body)
    for effort in ("none", "minimal"):
        assert not chat.thinking(ChatCompletionRequest(model="m", messages=USER, reasoning_effort=effort))
    both = ChatCompletionRequest(model="m", messages=USER, reasoning_effort="low", thinking_token_budget=7)
    assert chat.budget(both) == 7 and chat.budget(ChatCompletionRequest(model="m", messages=USER)) is None

    off = LiveServer(llm, template_kwargs={"enable_thinking": False}, thinking_budget=3)
    try:
        client = off.client()
        r = client.chat.completions.create(model="test-model", messages=USER, max_tokens=4, temperature=0,
                                           extra_body={"return_token_ids": True})
        prompt = llm.tokenizer.decode(r.prompt_token_ids)
        assert prompt.endswith("<think>\n\n</think>\n\n")
        assert "reasoning_content" not in r.choices[0].message.model_extra
        r = client.chat.completions.create(model="test-model", messages=USER, max_tokens=100, temperature=0,
                                           response_format={"type": "json_object"},
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                       "return_token_ids": True})
        assert r.choices[0].finish_reason == "stop"
        assert close_at(llm, r.choices[0].token_ids) == 3 + 1   # --thinking-budget 3
        json.loads(r.choices[0].message.content)
    finally:
        off.close()


def test_the_serve_options_are_checked():
    assert template_kwargs_option('{"enable_thinking": false, "x": 1}') == {"enable_thinking": False, "x": 1}
    for bad, said in (("{", "not valid JSON"), ("[1]", "JSON object"), ('{"messages": []}', "cannot set 'messages'"),
                      ('{"enable_thinking": "no"}', "true or false")):
        with pytest.raises(NpqwenError, match=said):
            template_kwargs_option(bad)


def test_generate_takes_a_thinking_budget():
    schema = json.dumps(Pick.model_json_schema())
    code, out, err = run("generate", "-m", "tiny", "-p", "Pick", "-t", "0", "-n", "60", "--thinking-budget", "2",
                         "--json-schema", schema)
    assert code == 0 and "(stop)" in err
    Pick.model_validate_json(out.strip().split("</think>")[-1])
    code, _, err = run("generate", "-m", "tiny", "-p", "x", "--thinking-budget", "-1")
    assert code != 0 and "thinking_budget must be" in err
