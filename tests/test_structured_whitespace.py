"""JSON answers are compact by default (", " and ": ", no other whitespace between tokens), so a
weak model cannot spend its tokens on whitespace; "x-guidance": {"whitespace_flexible": true} gives
the flexible form (bounded: a space, or a newline and up to 20 spaces or tabs). The whitespace
share of the tiny model's answers at temperature 1 is printed for both."""
import json
import re

import pytest

pytest.importorskip("llguidance")

import npqwen  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    "c": {"type": "object", "properties": {"d": {"type": "boolean"}}, "required": ["d"],
          "additionalProperties": False}},
    "required": ["a", "b", "c"], "additionalProperties": False}
STRING = r'"(\\.|[^"\\])*"'


def between_tokens(text: str) -> str:
    """The answer with its strings emptied: what is left is JSON's own tokens and whitespace."""
    return re.sub(STRING, '""', text)


def whitespace_share(answers: list[str]) -> float:
    return sum(c.isspace() for a in answers for c in a) / sum(map(len, answers))


def answers(llm, schema, n=8) -> list[str]:
    out = [llm.generate("x", max_new_tokens=120, temperature=1, seed=seed, json_schema=schema) for seed in range(n)]
    assert all(r.finish_reason == "stop" for r in out), [r.text for r in out]
    return [r.text for r in out]


def test_json_is_compact_by_default_and_flexible_when_asked():
    llm = npqwen.load("tiny")
    compact = answers(llm, SCHEMA)
    flexible = answers(llm, {**SCHEMA, "x-guidance": {"whitespace_flexible": True}})
    print(f"whitespace share of the tiny model's JSON at temperature 1: compact {whitespace_share(compact):.1%}, "
          f"flexible {whitespace_share(flexible):.1%}")
    for text in compact:   # as json.dumps writes it: nothing but the separators' one space (the keys are ASCII)
        assert text == json.dumps(json.loads(text)), text
    assert whitespace_share(compact) < 0.2 < whitespace_share(flexible)
    assert any("\n" in between_tokens(t) for t in flexible)
    assert not any(re.search(r"\n[ \t]{21}", between_tokens(t)) for t in flexible)   # still bounded
    for text in compact + flexible:
        json.loads(text)
