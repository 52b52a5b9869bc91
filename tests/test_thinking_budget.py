"""The thinking budget (npqwen/engine/thinking.py): a request's reasoning ends at its budget with
"\\n</think>\\n\\n" written for it; a constrained request with thinking on and no budget ends its
reasoning at half its max_new_tokens, so its answer always has room."""
import json

import pytest

import npqwen
from npqwen import NpqwenError, SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny():
    return npqwen.load("tiny")


def close_ids(tiny):
    return tiny.tokenizer.encode("\n</think>\n\n")


def test_the_budget_is_checked():
    assert SamplingParams(thinking_budget=0).thinking_budget == 0
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(NpqwenError, match="thinking_budget must be"):
            SamplingParams(thinking_budget=bad)


def test_reasoning_ends_at_its_budget(tiny):
    prompt = tiny.chat_prompt([{"role": "user", "content": "hi"}]) + "<think>\n"   # the reasoning is open
    for budget in (0, 5):
        r = tiny.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0, thinking=True,
                                                 thinking_budget=budget))
        close = close_ids(tiny)
        assert r.token_ids[budget:budget + len(close)] == close, (budget, r.token_ids)
    free = tiny.generate(prompt, SamplingParams(max_new_tokens=20, temperature=0, thinking=True))
    assert tiny.tokenizer.token_to_id("</think>") not in free.token_ids   # random weights never close it alone


def test_the_budget_counts_from_the_answers_own_think(tiny):
    """A chat prompt leaves "<think>" to the model: a constraint makes it the first token, which counts."""
    r = tiny.chat([{"role": "user", "content": "hi"}], max_new_tokens=40, temperature=0, thinking_budget=3,
                  json_schema=SCHEMA)
    assert r.token_ids[0] == tiny.tokenizer.token_to_id("<think>")
    assert r.token_ids[3:3 + len(close_ids(tiny))] == close_ids(tiny)
    assert r.finish_reason == "stop" and json.loads(r.content)["a"] in range(100)


def test_no_budget_without_thinking(tiny):
    prompt = tiny.chat_prompt([{"role": "user", "content": "hi"}]) + "<think>\n"
    r = tiny.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, thinking_budget=2))
    assert r.token_ids[2:2 + len(close_ids(tiny))] != close_ids(tiny)


def test_a_constrained_answer_always_has_room(tiny):
    """Before: the reasoning of a constrained request took every token ("length", no content)."""
    for max_new_tokens in (16, 40):   # the tiny model writes a byte a token: 4 tokens for "yes"
        r = tiny.chat([{"role": "user", "content": "hi"}], max_new_tokens=max_new_tokens, temperature=0,
                      choice=["yes", "no"])
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        assert r.content in ("yes", "no")
        close = r.token_ids.index(tiny.tokenizer.token_to_id("</think>"))
        assert close <= max_new_tokens // 2 + 1   # "<think>" and the reasoning, then "\n</think>"
