"""A thinking budget: Qwen3's reasoning ends, at the latest, after a set number of tokens.

With thinking on, Qwen3 answers "<think>\\n reasoning \\n</think>\\n\\n content". A request whose
reasoning reaches its budget (SamplingParams.thinking_budget) has the end of its thinking written
for it: the engine puts "\\n</think>\\n\\n" in place of its next draws, as Qwen's own guidance
does, and the model goes on to the answer. A constrained request with thinking on and no budget
of its own gets half its max_new_tokens, so that its constrained answer always has room.

The budget counts the answer's tokens from its start ("<think>" included) while it reasons; a
prompt that already opened the reasoning (ends with "<think>") counts from the first token.
"""
from dataclasses import dataclass, field

from ..chat_format import THINK_CLOSE, THINK_OPEN, opens_reasoning

FORCED_CLOSE = "\n</think>\n\n"   # what ends the thinking when the budget is spent


@dataclass
class ThinkingBudget:
    """One request's reasoning: where it is, the tokens spent, the close still to write."""
    budget: int                     # reasoning tokens allowed before the close is forced
    open_id: int                    # "<think>"
    close_id: int                   # "</think>"
    close_ids: list[int]            # FORCED_CLOSE as tokens
    state: str = "before"           # "before" the answer opens its reasoning, "reasoning", or "done"
    spent: int = 0                  # tokens written while reasoning
    forcing: list[int] = field(default_factory=list)   # the rest of the close being written

    def forced(self) -> int | None:
        """The token to write next in place of a draw, or None to draw as usual."""
        if self.state == "reasoning" and self.spent >= self.budget:
            self.state, self.forcing = "done", list(self.close_ids)
        return self.forcing.pop(0) if self.forcing else None

    def take(self, token: int):
        """Follow the answer's next token (drawn or forced)."""
        if self.state == "before":   # the answer's first token opens the reasoning, or there is none
            self.state = "reasoning" if token == self.open_id else "done"
        elif self.state == "reasoning" and token == self.close_id:   # the model closed it itself
            self.state = "done"
        if self.state == "reasoning":
            self.spent += 1


def thinking_budget(params, max_new_tokens: int, tokenizer, prompt_ids) -> ThinkingBudget | None:
    """The ThinkingBudget of a request (None without one): params.thinking_budget, or for a
    constrained request with thinking on, half of its max_new_tokens."""
    budget = params.thinking_budget
    if budget is None and params.constraint is not None:
        budget = max_new_tokens // 2
    if not params.thinking or budget is None or tokenizer is None:
        return None
    open_id, close_id = tokenizer.token_to_id(THINK_OPEN), tokenizer.token_to_id(THINK_CLOSE)
    if open_id is None or close_id is None:   # a vocabulary without Qwen3's tags: no reasoning to close
        return None
    tail = tokenizer.decode(list(prompt_ids)[-4:]).rstrip("\n")
    if tail.endswith(THINK_CLOSE):            # the prompt closed the reasoning (thinking off): nothing to do
        return None
    state = "reasoning" if opens_reasoning(tail) else "before"
    return ThinkingBudget(budget, open_id, close_id, tokenizer.encode(FORCED_CLOSE), state)
