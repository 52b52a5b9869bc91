"""Qwen3 output -> OpenAI message fields: reasoning, content and tool calls, whole or streamed.

The reasoning is split off by npqwen/chat_format.py's one rule (shared with llm.chat). Tool calls are
parsed as vLLM's and SGLang's Qwen3 (hermes) tool parsers do.

The streaming parser re-parses the whole text seen so far with the same functions and sends only what
is new, so what it streams always joins into what parse_output returns for the whole text.
"""
import json
import uuid
from typing import Callable, NamedTuple

from ..chat_format import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN, split_reasoning

TAGS = (THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE)


class Parsed(NamedTuple):
    reasoning: str           # inside <think> ... </think>, "" when there is none
    content: str             # the answer, without the tool-call blocks
    tool_calls: list[dict]   # OpenAI's {"id", "type": "function", "function": {"name", "arguments"}}


def random_call_id(index: int) -> str:
    """An OpenAI-style tool-call id, "call_" and 24 hex digits; the index is not used."""
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of the JSON inside <tool_call>...</tool_call>, None if invalid."""
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments") or {}
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)   # ensure_ascii=False as vLLM


def split_tool_calls(content: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]): valid tool-call blocks come out, everything else stays content.

    A block whose JSON does not parse, and a block never closed, stay in the content as written.
    Whitespace just before a call is dropped (Qwen3 writes "\\n\\n" there), and so is a whitespace-only
    stretch after the last call (the "\\n" between or after calls).
    """
    segments, calls, rest = [""], [], content   # segments[k]: the text after the k-th call
    while (start := rest.find(TOOL_OPEN)) >= 0 and (end := rest.find(TOOL_CLOSE, start)) >= 0:
        call = parse_call(rest[start + len(TOOL_OPEN):end])
        if call is None:                          # keep the invalid block as text
            segments[-1] += rest[:end + len(TOOL_CLOSE)]
        else:
            segments[-1] += rest[:start]
            calls.append(call)
            segments.append("")
        rest = rest[end + len(TOOL_CLOSE):]
    segments[-1] += rest
    if not calls:
        return segments[0], []
    text = "".join(s.rstrip() for s in segments[:-1])
    return text + (segments[-1] if segments[-1].strip() else ""), calls


def parse_output(text: str, thinking: bool = True, call_id: Callable[[int], str] = random_call_id,
                 tools: bool = True, opened: bool = False) -> Parsed:
    """Reasoning, content and tool calls of a whole Qwen3 answer; call_id(i) names the i-th call.
    With tools False (none offered, or tool_choice "none") a <tool_call> block is plain content."""
    reasoning, content = split_reasoning(text, thinking, opened)
    content, calls = split_tool_calls(content) if tools else (content, [])
    tool_calls = [{"id": call_id(i), "type": "function", "function": {"name": name, "arguments": args}}
                  for i, (name, args) in enumerate(calls)]
    return Parsed(reasoning, content, tool_calls)


def finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    """OpenAI says "tool_calls" when the model stopped after calling tools; else the engine's reason."""
    return "tool_calls" if has_tool_calls and engine_reason == "stop" else engine_reason


def partial_tag_length(text: str) -> int:
    """Length of the end of text that could still become a tag ("<thi", "</", "<tool_c"), else 0."""
    for n in range(min(len(text), max(map(len, TAGS)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) and n < len(tag) for tag in TAGS):
            return n
    return 0


def unclosed_call_start(content: str) -> int:
    """Where a <tool_call> with no </tool_call> yet starts (paired as split_tool_calls pairs them), or -1."""
    i = 0
    while (start := content.find(TOOL_OPEN, i)) >= 0:
        end = content.find(TOOL_CLOSE, start)
        if end < 0:
            return start
        i = end + len(TOOL_CLOSE)
    return -1


def new_suffix(sent: str, now: str) -> str:
    """What to send after `sent` to reach `now`; a parse of more text only ever extends a field."""
    assert now.startswith(sent), f"streamed {sent!r} is not a prefix of {now!r}"
    return now[len(sent):]


def completed_calls(pending: dict, delta: dict) -> list[dict]:
    """The tool calls a streamed delta completes, whole ({"id", "function": {"name", "arguments"}}):
    StreamParser sends a call's id and name first, then its arguments; `pending` keeps the started
    calls by index in between."""
    done = []
    for call in delta.get("tool_calls", []):
        if "id" in call:
            pending[call["index"]] = {"id": call["id"], "function": {"name": call["function"]["name"], "arguments": ""}}
            continue
        whole = pending.pop(call["index"])
        whole["function"]["arguments"] += call["function"]["arguments"]
        done.append(whole)
    return done


class StreamParser:
    """Turns text pieces, split anywhere, into OpenAI streaming deltas; finish() flushes what is held.

    Each feed re-parses everything seen so far (linear in the answer, cheap next to a forward pass)
    with these held back until they are decided, so that no field ever has to take text back:
    leading newlines (a "<think>" may still follow), a partial tag at the end ("<thi"), a tool call not yet closed (its JSON may still be invalid, and
    then it is content), and trailing whitespace of the content (dropped if a tool call follows).
    A tool call is therefore sent whole once "</tool_call>": a first delta with its id and name, then
    its arguments as one fragment, the same JSON string parse_output gives.
    """

    def __init__(self, thinking: bool = True, call_id: Callable[[int], str] = random_call_id, tools: bool = True,
                 opened: bool = False):
        self.thinking, self.call_id, self.tools, self.opened = thinking, call_id, tools, opened
        self.text = ""                       # everything fed so far
        self.reasoning = self.content = ""   # what has been sent of each
        self.n_calls = 0                     # tool calls sent

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        return self.deltas(final=False)

    def finish(self) -> list[dict]:
        return self.deltas(final=True)

    def deltas(self, final: bool) -> list[dict]:
        """Parse the text (all of it when final, else the decided part) and return what is new."""
        text = self.text if final else self.text[:len(self.text) - partial_tag_length(self.text)]
        if not final and self.thinking and not self.opened and not text.strip("\n"):
            return []                                 # only newlines yet: "<think>" may still come
        reasoning, content = split_reasoning(text, self.thinking, self.opened)
        calls = []
        if self.tools:
            if not final and (start := unclosed_call_start(content)) >= 0:
                content = content[:start]
            content, calls = split_tool_calls(content)
        if not final and self.tools:
            content = content.rstrip()

        out = []
        if delta := new_suffix(self.reasoning, reasoning):
            out.append({"reasoning_content": delta})
        if delta := new_suffix(self.content, content):
            out.append({"content": delta})
        for i, (name, arguments) in enumerate(calls[self.n_calls:], start=self.n_calls):
            out.append({"tool_calls": [{"index": i, "id": self.call_id(i), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": arguments}}]})
        self.reasoning, self.content, self.n_calls = reasoning, content, len(calls)
        return out
