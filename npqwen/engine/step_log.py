"""What each step ran, kept only when asked (Engine(..., record_steps=True)): one list of rows per step.

    engine = Engine(llm, record_steps=True)
    ... engine.step() ...
    engine.step_log[3]     # [Scheduled("req-0", start=17, prompt_tokens=0, decode_tokens=1), ...]

A row is one request of the scheduler's plan for that step, in batch order: the positions it had
cached before the step and how many of the tokens it computed were prompt tokens and how many were
tokens it generated (1 when decoding; more only when a preempted request recomputes what it had
generated). The notebook's timeline (notebooks/03-engine.md) is drawn from it. A request that speculates
(docs/speculative.md) also computes its drafts: the row names them and, after the step, how many it kept.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Scheduled:
    """One request's share of one step."""
    request_id: str
    start: int                 # positions whose keys/values it had cached before the step
    prompt_tokens: int         # prompt positions computed in this step (a chunk of prefill)
    decode_tokens: int         # generated positions computed in this step: 1 when decoding
    draft_tokens: int = 0      # speculative decoding: drafts verified beside its last token (2. verify)
    accepted_tokens: int | None = None   # ... and how many of them it kept (3. accept); None: no drafts
    drafts: tuple[int, ...] = ()         # the drafts themselves (1. propose); the first accepted_tokens were kept

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.decode_tokens + self.draft_tokens


def scheduled(plan) -> list[Scheduled]:
    """The rows of one step's plan [(request, n tokens)], read before the step computes them."""
    rows = []
    for req, n in plan:
        prompt = max(0, min(req.cached_len + n, len(req.prompt_ids)) - req.cached_len)
        drafts = len(req.drafts)
        rows.append(Scheduled(req.request_id, req.cached_len, prompt, n - prompt - drafts, drafts, None,
                              tuple(req.drafts)))
    return rows
