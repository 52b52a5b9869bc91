"""Qwen3's chat format: the strings that mark reasoning and tool calls in an answer, and the one rule
that splits an answer into its reasoning and its content (llm.chat, `npqwen chat`, the server).

Qwen3 writes its answer as

    <think>\\n reasoning \\n</think>\\n\\n content
    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>

With thinking on, an answer that starts with "<think>" (Qwen3's chat template leaves it to the
model) is reasoning up to "</think>" and content after it; so is every answer when the prompt
itself ended with "<think>" (`opened`, as later Qwen3 thinking templates do). An answer cut off
before "</think>" is all reasoning, no content (it was never an answer). An answer that does not
start with "<think>", and any answer with thinking off, is all content. Tool calls are parsed in
server/parsers.py.

The template writes a message only for the roles in ROLES and skips any other without a word, so
check_roles refuses one (every chat prompt goes through it: llm.chat_prompt, llm.chat, the CLI, the
server, whose request schema takes these roles and OpenAI's "developer" for "system").
"""
import difflib

from .errors import NpqwenError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ROLES = ("system", "user", "assistant", "tool")   # the roles Qwen3's chat template writes


def check_roles(messages: list[dict]) -> None:
    """Refuse a message whose role the chat template would drop ("usr", "System", "developer")."""
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            near = "system" if role == "developer" else \
                next(iter(difflib.get_close_matches(str(role).lower(), ROLES, n=1)), None)
            hint = f"; did you mean {near!r}?" if near else ""
            raise NpqwenError(f"messages[{i}].role is {role!r}: the chat template takes only the roles "
                              f"{', '.join(map(repr, ROLES))} and would leave this message out{hint}")


def opens_reasoning(prompt: str) -> bool:
    """The prompt itself opened the reasoning: it ends with "<think>" (and maybe newlines)."""
    return prompt.rstrip("\n").endswith(THINK_OPEN)


def split_reasoning(text: str, thinking: bool = True, opened: bool = False) -> tuple[str, str]:
    """(reasoning, content), with the newlines around the tags stripped as Qwen3's chat template does;
    `opened`: the prompt already ended with "<think>"."""
    if not thinking:
        return "", text
    if text.lstrip("\n").startswith(THINK_OPEN):          # "<think>" only opens at the start
        text = text.lstrip("\n")[len(THINK_OPEN):]
    elif not opened:
        return "", text                                     # the model did not think
    reasoning, _, content = text.partition(THINK_CLOSE)    # no "</think>": cut off while thinking
    return reasoning.strip("\n"), content.lstrip("\n")
