"""Serving many requests at once: continuous batching over a paged KV cache with a prefix cache.

    request.py       a request's tokens, pages, sampling state and text (Request, StepOutput)
    pages.py         the fixed pool of KV-cache pages and its reference counts (PagePool)
    prefix_cache.py  full pages reused by requests that share a prefix, LRU eviction (PrefixCache)
    scheduler.py     who runs in the next step, with how many tokens, preemption (Scheduler)
    state_slots.py   a hybrid model's per-request linear-attention states: which slots are free (StateSlots)
    state_snapshots.py  copies of those states at the end of cached prefixes, for prefix hits (StateSnapshots)
    prefill_only.py  requests that only read their prompt: embeddings and rerank scores (PrefillRows)
    engine.py        add_request / step / abort: one packed forward pass per step (Engine)
    step_log.py      what each step ran, kept when asked (Engine(record_steps=True)): the notebook's timeline
    run.py           the one loop that drives it for a caller: a set of requests, stepped to their end (run)
"""
from .engine import Engine
from .request import Request, StepOutput

__all__ = ["Engine", "Request", "StepOutput"]
