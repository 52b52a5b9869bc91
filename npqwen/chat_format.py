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
"""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


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
