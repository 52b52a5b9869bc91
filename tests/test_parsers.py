"""The Qwen3 output parsers: reasoning, content and tool calls, and streaming that joins to the same."""
import json
import random

import pytest

from npqwen.server.parsers import StreamParser, finish_reason, parse_output, split_reasoning


def counter(i):
    return f"call_{i}"


def call(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


WEATHER = call("get_weather", {"city": "Paris", "unit": "C"})
TIME = call("get_time", {"tz": "Europe/Paris"})

# (text, thinking, opened): answers the streaming parser must reproduce piece by piece
TEXTS = [
    ("Hello, world!\nSecond line.\n", False),
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", True),
    ("Let me think.\n</think>\n\nThe answer is 4.", True, True),         # "<think>" was in the prompt
    ("Let me think.\n</think>\n\nThe answer is 4.", True),               # ... or not: all content
    ("<think>\nStill thinking, cut off here", True),
    ("Cut off while thinking, no tags at all", True, True),
    ("No thinking at all", True),
    ("\n\n<think>\nlate start\n</think>\n\nok", True),
    ("<think>\nweather?\n</think>\n\nLet me check.\n\n" + WEATHER, True),
    ("I will call two tools.\n\n" + WEATHER + "\n" + TIME, False),
    (call("ping", {}), False),
    ('<tool_call>\n{"name": "ping"}\n</tool_call>', False),
    ("Oops:\n<tool_call>\n{not json}\n</tool_call>\nmore", False),
    ("a < b and c > d, <b>bold</b> </p> <to <thinking> </t", False),
    ("<think>\nis a < b? </thin no\n</think>\n\n<b>yes</b> <", True),
    (WEATHER + "\nDone, it is sunny.", False),
    ("Unclosed <tool_call>\n{\"name\": \"x\"", False),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "café ☕"}}\n</tool_call>', False),
]


@pytest.mark.parametrize("text, thinking, reasoning, content", [
    ("<think>\nhm\n</think>\n\nfour", True, "hm", "four"),
    ("hm\n</think>\n\nfour", (True, True), "hm", "four"),                  # opened by the prompt
    ("hm\n</think>\n\nfour", True, "", "hm\n</think>\n\nfour"),            # not opened: the model did not think
    ("\n<think>\nhm", True, "hm", ""),                                     # cut off inside <think>
    ("no tags", (True, True), "no tags", ""),                               # cut off, opened by the prompt
    ("no tags", True, "", "no tags"),
    ("no tags", False, "", "no tags"),
    ("<think>\nhm\n</think>\n\nfour", False, "", "<think>\nhm\n</think>\n\nfour"),
    ("<think>\n\n</think>\n\nfour", True, "", "four"),
])
def test_split_reasoning(text, thinking, reasoning, content):
    thinking, opened = thinking if isinstance(thinking, tuple) else (thinking, False)
    assert split_reasoning(text, thinking, opened) == (reasoning, content)


def test_one_tool_call():
    out = parse_output("<think>\nweather?\n</think>\n\nLet me check.\n\n" + WEATHER, call_id=counter)
    assert out.reasoning == "weather?"
    assert out.content == "Let me check."
    assert out.tool_calls == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]


def test_two_tool_calls():
    out = parse_output(WEATHER + "\n" + TIME + "\n", thinking=False, call_id=counter)
    assert out.content == ""
    assert [c["id"] for c in out.tool_calls] == ["call_0", "call_1"]
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[1]["function"]["arguments"]) == {"tz": "Europe/Paris"}


@pytest.mark.parametrize("block", [call("ping", {}), '<tool_call>\n{"name": "ping"}\n</tool_call>',
                                   '<tool_call>{"name": "ping", "arguments": null}</tool_call>'])
def test_empty_or_missing_arguments_are_an_empty_object(block):
    assert parse_output(block, thinking=False).tool_calls[0]["function"]["arguments"] == "{}"


def test_non_ascii_arguments_stay_as_written():
    out = parse_output(TEXTS[-1][0], thinking=False)
    assert out.tool_calls[0]["function"]["arguments"] == '{"q": "café ☕"}'


@pytest.mark.parametrize("text", [
    "Oops:\n<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n["name", "x"]\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',                        # no name
    '<tool_call>\n{"name": "x", "arguments": "a string"}\n</tool_call>',
    'Unclosed <tool_call>\n{"name": "x", "arguments": {}}',
])
def test_invalid_tool_calls_stay_content(text):
    out = parse_output(text, thinking=False)
    assert (out.content, out.tool_calls) == (text, [])


def test_invalid_call_kept_beside_a_valid_one():
    out = parse_output("<tool_call>\n{bad}\n</tool_call>\n" + WEATHER, thinking=False)
    assert out.content == "<tool_call>\n{bad}\n</tool_call>"
    assert len(out.tool_calls) == 1


def test_text_after_a_call_is_kept():
    out = parse_output("Checking.\n\n" + WEATHER + "\nIt is sunny.", thinking=False)
    assert out.content == "Checking.\nIt is sunny."


def test_tool_call_inside_reasoning_is_reasoning():
    out = parse_output("<think>\nmaybe " + WEATHER + "\n</think>\n\nNo tool needed.")
    assert out.tool_calls == [] and WEATHER in out.reasoning and out.content == "No tool needed."


def test_default_ids_are_random_call_ids():
    ids = {parse_output(WEATHER, thinking=False).tool_calls[0]["id"] for _ in range(5)}
    assert len(ids) == 5 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def stream(text, thinking, cuts, opened=False):
    """Feed text cut at the given positions; return all the deltas, finish() included."""
    parser, deltas, start = StreamParser(thinking, call_id=counter, opened=opened), [], 0
    for end in [*cuts, len(text)]:
        deltas += parser.feed(text[start:end])
        start = end
    return deltas + parser.finish()


def join(deltas):
    """The streamed deltas joined back into (reasoning, content, tool calls), checking their shape."""
    reasoning, content, calls = "", "", []
    for d in deltas:
        assert len(d) == 1 and next(iter(d.values())), d   # one non-empty field per delta
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):                    # the first delta of a call names it
                assert tc["function"]["arguments"] == ""
                calls.append({"id": tc["id"], "type": tc["type"], "function": dict(tc["function"])})
            else:
                assert set(tc) == {"index", "function"} and tc["index"] == len(calls) - 1
                calls[-1]["function"]["arguments"] += tc["function"]["arguments"]
    return reasoning, content, calls


@pytest.mark.parametrize("text, thinking, opened", [(*t, False)[:3] for t in TEXTS])
def test_stream_joins_to_the_whole_parse(text, thinking, opened):
    expected = tuple(parse_output(text, thinking, call_id=counter, opened=opened))
    rng = random.Random(0)
    splits = [list(range(1, len(text))), []]                 # one character at a time, all at once
    splits += [sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 2))) for _ in range(200)]
    for cuts in splits:
        assert join(stream(text, thinking, cuts, opened)) == expected, cuts


def test_stream_holds_partial_tags_back():
    parser = StreamParser(thinking=False)
    assert parser.feed("Hello <tool_c") == [{"content": "Hello"}]   # " " waits: a call may follow
    assert parser.feed("all>\n{bad") == []                           # an open call is held whole
    assert parser.feed("}\n</tool_call>") == [{"content": " <tool_call>\n{bad}\n</tool_call>"}]
    parser = StreamParser(thinking=True)
    assert parser.feed("\n") == [] and parser.feed("<thi") == []        # thinking may still begin
    assert parser.feed("nk>hm</th") == [{"reasoning_content": "hm"}]
    assert parser.feed("ink>\n\nok") == [{"content": "ok"}]
    parser = StreamParser(thinking=False)
    assert parser.feed("a <") == [{"content": "a"}]
    assert parser.feed(" b") == [{"content": " < b"}]
    assert parser.feed("<") == [] and parser.finish() == [{"content": "<"}]


def test_stream_tool_call_deltas_in_openai_shape():
    parser = StreamParser(thinking=False, call_id=counter)
    assert parser.feed(WEATHER[:20]) == []
    assert parser.feed(WEATHER[20:]) == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris", "unit": "C"}'}}]}]
    assert parser.feed("\n") == [] and parser.finish() == []


@pytest.mark.parametrize("engine_reason, has_tool_calls, expected", [
    ("stop", True, "tool_calls"), ("stop", False, "stop"),
    ("length", True, "length"), ("length", False, "length")])
def test_finish_reason(engine_reason, has_tool_calls, expected):
    assert finish_reason(engine_reason, has_tool_calls) == expected


def test_stream_joins_to_the_whole_parse_on_random_tag_soup():
    atoms = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", "\n\n", " ", "a", "<", "</", "<t",
             '{"name": "f", "arguments": {"x": 1}}', '{"name": "g"}', "{}", "{bad"]
    rng = random.Random(1)
    for _ in range(1500):
        text, thinking = "".join(rng.choices(atoms, k=rng.randint(0, 12))), rng.random() < 0.5
        opened = thinking and rng.random() < 0.5
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
        expected = tuple(parse_output(text, thinking, counter, opened=opened))
        assert join(stream(text, thinking, cuts, opened)) == expected, (text, cuts, opened)
