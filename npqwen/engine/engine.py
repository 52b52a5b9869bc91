"""The engine: many requests at once over one model, one packed forward pass per step.

    engine = Engine(llm)
    rid = engine.add_request("The capital of France is", max_new_tokens=20, temperature=0)
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, repr(out.text), out.finish_reason)

A step: the scheduler picks (request, n tokens) pairs under the token budget and gives them
pages; their tokens are packed into one Batch and run through the model once (every matmul
sees all of them); each request whose last known token was in the batch samples its next
token from its own logits row with its own random generator; finished requests give their
pages back at once, and the next step can admit a waiting request in their place.
"""
import itertools
import math

import numpy as np

from ..backend import free_memory_bytes, to_numpy
from ..errors import NpqwenError
from ..generate import StopStrings, check_request, is_integer
from ..model import Batch, KVCache
from ..parallel import rank_0_leads
from ..sampling import candidates, draw, sampling_params
from ..sampling import logprobs as sampling_logprobs
from .pages import PagePool
from .prefix_cache import PrefixCache
from .request import Request, StepOutput
from .scheduler import Scheduler

DEFAULT_PAGE_SIZE = 256        # positions per page; see ops.paged_attention for why pages are large
KV_MEMORY_SHARE = 0.5          # default KV pool: this share of the memory free when the engine starts


class Engine:
    # Under tensor parallelism the engine lives on rank 0 (npqwen/parallel.py): on the other ranks
    # each @rank_0_leads method runs rank 0's forward passes, then returns rank 0's result.
    @rank_0_leads
    def __init__(self, llm, kv_cache_tokens: int | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                 max_batch_size: int = 64, max_batched_tokens: int = 512, prefix_cache: bool = True):
        self.llm, self.model, self.config = llm, llm.model, llm.config
        for name, value in (("page_size", page_size), ("max_batch_size", max_batch_size),
                            ("max_batched_tokens", max_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NpqwenError(f"{name} must be an integer >= 1, got {value!r}")
        per_token = KVCache.bytes_per_token(self.config, self.model.dtype)
        if kv_cache_tokens is None:   # a share of free memory, but no more than a full batch of full contexts
            fits = int(free_memory_bytes(self.model.xp) * KV_MEMORY_SHARE) // per_token
            kv_cache_tokens = min(fits, max_batch_size * self.config.max_position_embeddings)
        if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int) or kv_cache_tokens < page_size:
            raise NpqwenError(f"kv_cache_tokens must be an integer >= page_size ({page_size}), got {kv_cache_tokens!r}")
        self.page_size = page_size
        self.kv = KVCache(self.config, kv_cache_tokens // page_size, page_size, self.model.xp, self.model.dtype,
                          getattr(self.model, "kv_heads", None))   # this rank's heads (a stand-in model: all)
        self.pool = PagePool(self.kv.num_pages)
        self.cache = PrefixCache(self.pool, page_size, enabled=prefix_cache)
        self.scheduler = Scheduler(self.cache, max_batch_size, max_batched_tokens)
        self.requests: dict[str, Request] = {}       # unfinished requests by id
        self._ids = itertools.count()

    @rank_0_leads
    def add_request(self, prompt, max_new_tokens: int = 512, temperature=None, top_k=None, top_p=None,
                    min_p=None, repetition_penalty=None, presence_penalty=None, seed=None, stop=None,
                    frequency_penalty=None, logprobs=None) -> str:
        """Queue a prompt (text, used as is, or token ids); its request id. Everything is checked now."""
        return self.add(self.new_request(prompt, max_new_tokens, temperature, top_k, top_p, min_p,
                                         repetition_penalty, presence_penalty, seed, stop, frequency_penalty,
                                         logprobs))

    def new_request(self, prompt, max_new_tokens: int = 512, temperature=None, top_k=None, top_p=None,
                    min_p=None, repetition_penalty=None, presence_penalty=None, seed=None, stop=None,
                    frequency_penalty=None, logprobs=None) -> Request:
        """A checked Request, not queued yet (see add). `logprobs` (an int k >= 0) makes each output
        carry the sampled token's log probability and the k most likely alternatives."""
        ids = self.llm.prompt_ids(prompt)
        stop, max_new_tokens = check_request(self.config, ids, max_new_tokens, stop)
        params = sampling_params(self.llm.generation_defaults, temperature=temperature, top_k=top_k, top_p=top_p,
                                 min_p=min_p, repetition_penalty=repetition_penalty,
                                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed)
        if logprobs is not None and (not is_integer(logprobs) or logprobs < 0):
            raise NpqwenError(f"logprobs must be None or an integer >= 0 (alternatives per token), got {logprobs!r}")
        need = math.ceil((len(ids) + max_new_tokens) / self.page_size)
        if need > self.pool.num_pages:
            raise NpqwenError(f"a prompt of {len(ids)} tokens plus max_new_tokens {max_new_tokens} needs {need} KV "
                              f"pages of {self.page_size} positions, but the pool has {self.pool.num_pages} "
                              f"({self.pool.num_pages * self.page_size} positions); lower max_new_tokens or give "
                              f"the engine a larger kv_cache_tokens")
        tokenizer = self.llm.tokenizer
        return Request(f"req-{next(self._ids)}", ids, max_new_tokens, params, frozenset(self.llm.eos_token_ids),
                       StopStrings(stop), tokenizer.stream_decoder() if tokenizer is not None else None,
                       None if logprobs is None else int(logprobs))

    def add(self, req: Request) -> str:
        """Queue a request made by new_request; its id."""
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    @rank_0_leads
    def step(self) -> list[StepOutput]:
        """Run one scheduling step; one output per request that advanced."""
        plan = self.scheduler.schedule()
        if not plan:
            return []
        # 1. pack: each request's next n tokens, its cached length and its pages
        samples = [req.cached_len + n == len(req.tokens) for req, n in plan]   # its last known token is in?
        lengths = [n for _, n in plan]
        ends = np.cumsum(lengths)
        batch = Batch(np.array([t for req, n in plan for t in req.tokens[req.cached_len:req.cached_len + n]]),
                      starts=[req.cached_len for req, _ in plan], lengths=lengths,
                      page_tables=[np.array(req.page_table) for req, _ in plan], page_size=self.page_size,
                      sample_rows=(ends - 1)[samples])
        # 2. one forward pass for all of them; logits only for the rows that sample
        logits = to_numpy(self.model.forward_batch(batch, self.kv))                   # (sampling requests, V)
        # 3. each request takes its tokens' keys/values as computed and, if its turn, samples
        outputs, row = [], 0
        for (req, n), sample in zip(plan, samples):
            req.cached_len += n
            self._remember_full_pages(req)
            if not sample:
                outputs.append(StepOutput(req.request_id, [], ""))
                continue
            ids, candidate_logits = candidates(logits[row], req.params, req.prompt_ids, req.output_ids)
            token = draw(ids, candidate_logits, req.params, req.rng)
            row += 1
            out = req.append(token)
            if req.logprobs is not None:
                out.logprobs = [sampling_logprobs(ids, candidate_logits, token, req.logprobs)]
            outputs.append(out)
            if req.finished:
                self._finish(req)
        return outputs

    @rank_0_leads
    def abort(self, request_id: str) -> StepOutput:
        """End a request now and give its pages back; its final output (finish_reason "abort")."""
        req = self.requests.get(request_id)
        if req is None:
            raise NpqwenError(f"no unfinished request {request_id!r}")
        req.finish_reason = "abort"
        self._finish(req)
        return StepOutput(req.request_id, [], "", True, "abort", req.result())

    @rank_0_leads
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    @rank_0_leads
    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_pages_total": self.pool.num_pages, "kv_pages_free": len(self.pool.free),
                "kv_pages_cached": self.cache.cached_pages, "page_size": self.page_size,
                "prefix_cache_hit_tokens": self.cache.hit_tokens, "preemptions": self.scheduler.preemptions}

    @rank_0_leads
    def check(self):
        """The page bookkeeping invariants (see PagePool.check); the tests call it after every step."""
        self.pool.check([r.page_table for r in self.scheduler.running] + [r.page_table for r in self.scheduler.waiting],
                        self.cache.unused)
        self.cache.check()

    def _remember_full_pages(self, req: Request):
        """Pages filled by this step become known to the prefix cache (chain hash of the tokens up to their end)."""
        P = self.page_size
        while len(req.page_hashes) < req.cached_len // P:
            j = len(req.page_hashes)
            parent = req.page_hashes[-1] if req.page_hashes else None
            req.page_hashes.append(self.cache.register(req.page_table[j], parent, req.tokens[j * P:(j + 1) * P]))

    def _finish(self, req: Request):
        self.scheduler.finish(req)
        del self.requests[req.request_id]
