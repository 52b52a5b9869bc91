"""Generation, one sequence: prefill the prompt into a KV cache, then decode one token at a time.

    prefill(model, prompt_ids, cache)    -> logits of the last prompt token
    decode_one_token(model, token, cache) -> logits of the next position

These two show the idea on one sequence (docs/walkthrough.md, tools/bench/decode.py). `llm.generate`
runs through the engine (npqwen/engine/), which does the same for many requests at once. The
stop conditions are an eos id, a user stop string (excluded from the text, see StopStrings),
and max_new_tokens (finish_reason "length").
"""
import math
from dataclasses import dataclass, field


PREFILL_CHUNK = 512   # prompt tokens per forward call: bounds the activations of a long prompt


@dataclass
class GenerationResult:
    text: str                           # generated text, without the eos token or a stop string
    token_ids: list[int]                # generated tokens only (an eos token included, as HF returns it)
    finish_reason: str                  # "stop" (eos or stop string), "length" (max_new_tokens) or "error"
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0        # prompt -> first token's logits (time to first token)
    decode_seconds: float = 0.0         # the remaining tokens
    stop: str | None = None             # the stop string or eos token that ended generation
    error: str | None = None            # finish_reason "error": what failed (a constraint llguidance failed on)

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def generation_tokens_per_second(self) -> float:
        n = len(self.token_ids) - 1    # the first token came from the prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


@dataclass
class ChatResult(GenerationResult):
    reasoning: str = ""                 # what the model wrote inside <think> ... </think>
    content: str = ""                   # the answer after </think>
    messages: list = field(default_factory=list)   # the conversation including this answer


@dataclass
class ScoreResult:
    """How likely the model finds a text (llm.score): the log probability of each of its tokens
    given the ones before, under the model's own distribution (no sampling transform)."""
    token_ids: list[int]                # the text's tokens
    logprobs: list[float]               # log p(token i | tokens 0 .. i-1) for i = 1 .. T-1: the first has no context

    @property
    def total(self) -> float:
        """Sum of the logprobs: the log probability of the text after its first token."""
        return float(sum(self.logprobs))

    @property
    def perplexity(self) -> float:
        """exp(-mean logprob) over the tokens scored; nan if there are none (a text of one token)."""
        return math.exp(-self.total / len(self.logprobs)) if self.logprobs else math.nan


def prefill(model, prompt_ids, cache, chunk: int = PREFILL_CHUNK):
    """Run the prompt through the model in chunks, filling the cache; logits of the last token (V,)."""
    for start in range(0, len(prompt_ids), chunk):
        logits = model.forward(prompt_ids[start:start + chunk], cache=cache, last_only=True)
    return logits[0]


def decode_one_token(model, token_id: int, cache):
    """One step: the new token's keys/values join the cache; logits of the next position (V,)."""
    return model.forward([token_id], cache=cache)[0]


class StopStrings:
    """Holds back streamed text that could still turn into a stop string."""

    def __init__(self, stops):
        self.stops = [s for s in (stops or []) if s]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string if one completed)."""
        self.pending += piece
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at, stop = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, stop
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


