"""A request's life: waiting -> running (prefill in chunks, then one token per step) -> finished.

Its tokens are the prompt followed by what it generated. `cached_len` of them have their keys
and values in the request's pages (page_table[j] holds positions j*P .. j*P + P - 1); the rest
(the prompt's remainder, or the last sampled token) are what the next step computes. A
preempted request loses its pages and starts again from cached_len 0, with its tokens kept.
"""
import time
from dataclasses import dataclass, field

import numpy as np

from ..generate import GenerationResult, StopStrings
from ..sampling_params import SamplingParams
from ..structured import Constraint
from .thinking import ThinkingBudget


@dataclass
class StepOutput:
    """What one step did for one request."""
    request_id: str
    token_ids: list[int]                 # tokens sampled in this step (empty while the prompt is being read)
    text: str                            # new text: never ends inside a UTF-8 character or a possible stop string
    finished: bool = False
    finish_reason: str | None = None     # "stop" (eos, stop string, constraint complete), "length", "abort" or
                                         # "error" (its constraint failed: result.error says how)
    result: GenerationResult | None = None   # the whole result, once finished
    logprobs: list | None = None         # per sampled token, when asked: (log p, [(id, log p) most likely first])
    prompt_logprobs: list | None = None  # per prompt token scored in this step, when asked (Request.prompt_logprobs):
                                         # (log p, [(id, log p) most likely first], rank), the model's own distribution
    embedding: np.ndarray | None = None  # a finished "embed" request: its pooled hidden state (D,) float32
    scores: np.ndarray | None = None     # a finished "score" request: the logits of its score_ids (k,) float32
    drafts: list[int] | None = None      # speculative decoding: the drafts this step verified (None: it verified
                                         # none); token_ids[i] was draft i kept where token_ids[i] == drafts[i]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int                  # params.max_new_tokens, capped to the room left in the context
    params: SamplingParams               # with the checkpoint's defaults applied (SamplingParams.with_defaults)
    eos_ids: frozenset
    stops: StopStrings
    decoder: object = None               # the tokenizer's StreamDecoder, or None without a tokenizer
    logprobs: int | None = None          # report log p of each sampled token and this many alternatives; None: off
    leader: "Request | None" = None      # one of n choices: admitted once the leader has read the shared prompt
    prompt_logprobs: int | None = None   # score the prompt: log p of each prompt token after the first, and this
                                         # many alternatives (Engine._score_prompts); None: off
    prompt_scored: int = 1               # prompt tokens scored so far (the first has no context: never scored)
    probe: object = None                 # a recorder (recorder(name, array)): the request is a probe, its last token
                                         # runs alone with it, then it ends, sampling nothing (Engine._probe_pass)
    min_tokens: int = 0                  # no eos can be drawn, and no stop string ends it, before this many tokens
    include_stop: bool = False           # the stop string that ends the text stays in it
    constraint: Constraint | None = None     # structured output: the answer's mask and matcher (structured.py)
    thinking: ThinkingBudget | None = None   # its reasoning's budget: the close forced when spent (thinking.py)
    task: str | None = None              # None: generate; "embed" or "score": read the prompt only (prefill_only.py)
    pooling: str = "lasttoken"           # embed: which positions' final-norm states make the embedding (embed.py)
    score_ids: tuple = ()                # score: the tokens whose logits at the last position are the output
    prefix_reuse: bool = True            # False: every position is computed, none taken from the prefix cache
    steering: tuple = ()                 # steering.Steer items: s*v added to its rows after block L (steering.py)
    feature_edits: tuple = ()            # features.FeatureEdit items: a feature clamped/zeroed/scaled after block L
    steering_key: int | None = None      # its steering's part of the prefix cache's root: None, or its steering's
    lora: object = None                  # its LoRA adapter (npqwen/lora.py), or None: the base model
    pooled: np.ndarray | None = None     # embed: the pooling so far (mean: the running sum), float32
    pooled_upto: int = 0                 # embed: positions already folded into `pooled` (kept over a preemption)
    tokens: list[int] = field(init=False)       # prompt + generated
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0                  # positions whose keys/values are in the pages
    prompt_cached: int | None = None     # prompt positions the prefix cache served at its first admission
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[int] = field(default_factory=list)   # chain hash of each full page, in order
    state_slot: int | None = None        # hybrid models: its linear-attention states' slot while it runs
    snapshot_points: list[int] = field(default_factory=list)   # hybrid: positions (page ends) after which a
                                         # copy of its states is kept for prefix hits (Scheduler.snapshot_points)
    drafts: list[int] = field(default_factory=list)   # speculative decoding: tokens guessed after its last one,
                                         # verified by this step beside it (speculative.py); [] when it does not speculate
    mtp_cache: object = None             # speculative method "mtp": the MTP head's own KV cache (mtp.py), positions
                                         # fed to it so far; and the main model's final-norm states not fed yet
    mtp_hidden: dict = field(default_factory=dict)   # position -> (D,)
    text: str = ""
    finish_reason: str | None = None
    stop: str | None = None              # the stop string or eos token that ended it
    error: str | None = None             # finish_reason "error": what failed (Engine._fail)
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None        # when the scheduler first gave it pages (its time in the queue ends)
    token_times: list[float] = field(default_factory=list)   # when each token was sampled

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)
        self.rng = np.random.default_rng(self.params.seed)   # its own: the draw never depends on the batch

    @property
    def uncomputed(self) -> int:
        """Tokens whose keys/values are not in the cache yet: the prompt's rest, or the last sampled token."""
        return len(self.tokens) - self.cached_len

    @property
    def reusable(self) -> int:
        """Leading positions whose keys/values may come from the prefix cache: all but the last token
        (its logits are needed), and while the prompt is being scored, only the positions that
        scored it already (a cached position computes no logits)."""
        if not self.prefix_reuse:   # mean and CLS pooling read every position's state
            return 0
        if self.prompt_logprobs is not None and self.prompt_scored < len(self.prompt_ids):
            return self.prompt_scored - 1
        return len(self.tokens) - 1

    @property
    def cache_root(self):
        """Where its prefix-cache chain starts: keys and values computed under an adapter or a steering
        are theirs alone (None: the base model's, shared by every plain request)."""
        if self.lora is None and self.steering_key is None:
            return None
        return hash((None if self.lora is None else self.lora.key, self.steering_key))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> StepOutput:
        """Take a sampled token: check the stop conditions and turn it into text."""
        self.tokens.append(token)
        self.output_ids.append(token)
        self.token_times.append(time.perf_counter())
        if self.thinking is not None:
            self.thinking.take(token)
        piece = ""
        if token in self.eos_ids:
            self.finish_reason = "stop"
            self.stop = self.decoder.tokenizer.decode([token]) if self.decoder is not None else str(token)
        elif self.decoder is not None and len(self.output_ids) < self.min_tokens:   # too early to stop
            piece, hit = self.stops.flush() + self.decoder.push(token), None
        elif self.decoder is not None:
            piece, hit = self.stops.feed(self.decoder.push(token))
            if hit is not None:
                self.finish_reason, self.stop = "stop", hit
                self.decoder = None        # nothing held back may follow a stop string
                piece += hit if self.include_stop else ""
        if not self.finished and self.constraint is not None and \
                self.constraint.advance(token, len(self.output_ids) - 1):
            self.finish_reason, self.stop = "stop", None   # the constrained answer is complete
        if not self.finished and len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.finished and self.decoder is not None and self.finish_reason != "abort":
            piece += self._release_held_back()
        self.text += piece
        return StepOutput(self.request_id, [token], piece, self.finished, self.finish_reason,
                          self.result() if self.finished else None)

    def _release_held_back(self) -> str:
        """At the end: an unfinished character, or text that might have begun a stop string."""
        piece, hit = self.stops.feed(self.decoder.finish())
        if hit is not None:
            self.finish_reason, self.stop = "stop", hit
            return piece + (hit if self.include_stop else "")
        return piece + self.stops.flush()

    def result(self) -> GenerationResult:
        first = self.token_times[0] if self.token_times else time.perf_counter()
        last = self.token_times[-1] if self.token_times else first
        return GenerationResult(self.text, list(self.output_ids), self.finish_reason, len(self.prompt_ids),
                                prefill_seconds=first - self.arrival, decode_seconds=last - first,
                                stop=self.stop, error=self.error)
