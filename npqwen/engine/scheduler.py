"""The scheduler: which requests run in the next step, with how many tokens each, and their pages.

Each step has a budget of `max_batched_tokens` tokens. Running requests that are decoding come
first, one token each, so their streams never stall; then running requests still reading
their prompt get the next chunk of it; then waiting requests are admitted, oldest first, while
budget, batch room (`max_batch_size`) and pages last. So a long prompt that arrives is read a
chunk per step *beside* everyone's decode tokens (chunked prefill, as vLLM v1 and Sarathi-Serve
do) instead of freezing them.

For a hybrid model (Qwen3.5) a chunk also ends at each of the request's snapshot points, so that its
linear layers' states at a page boundary can be kept for a later prefix hit (state_snapshots.py).
"""
import time
from collections import deque

from .prefix_cache import PrefixCache
from .request import Request


class Scheduler:
    def __init__(self, cache: PrefixCache, max_batch_size: int, max_batched_tokens: int, states=None):
        self.cache, self.page_size = cache, cache.page_size
        self.states = states                   # a hybrid model's StateSlots (state_slots.py), else None
        self.max_batch_size, self.max_batched_tokens = max_batch_size, max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []       # in admission order: the last one is preempted first
        self.preemptions = 0

    def add(self, req: Request):
        self.waiting.append(req)

    def schedule(self) -> list[tuple[Request, int]]:
        """(request, number of its tokens to compute) for the next step."""
        plan: list[tuple[Request, int]] = []
        budget = self.max_batched_tokens
        preempted = False
        decoding = [r for r in self.running if r.uncomputed == 1]
        reading = [r for r in self.running if r.uncomputed > 1]
        for req in decoding + reading:
            if budget == 0:
                break
            if req not in self.running:          # preempted a moment ago to make room for an older one
                continue
            n = self.chunk(req, budget)
            if req.drafts and not self.room_for(req, req.cached_len + n):   # drafts never preempt anyone:
                req.drafts = []                                            # without pages for them, none
                n = self.chunk(req, budget)
            victims = self.make_room(req, req.cached_len + n)
            preempted |= bool(victims)
            plan = [(r, k) for r, k in plan if r not in victims]
            if req in victims:
                continue
            plan.append((req, n))
            budget = self.max_batched_tokens - sum(k for _, k in plan)
        # Admit waiting requests; never in a step that had to preempt (they would take the pages back).
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size and not preempted:
            req = self.waiting[0]
            if req.leader is not None and not req.leader.finished and req.leader.cached_len < len(req.prompt_ids):
                break                            # one of n choices: waits to share the leader's prompt pages
            if not self.admit(req, budget):
                break                            # wait for pages; a newcomer never preempts anyone
            self.waiting.popleft()
            self.running.append(req)
            n = self.chunk(req, budget)
            plan.append((req, n))
            budget -= n
        return plan

    def admit(self, req: Request, budget: int) -> bool:
        """Give a waiting request its cached prefix and the pages for its first chunk, or nothing."""
        P = self.page_size
        # a fully cached prompt still computes its last token: that is where its logits come from
        pages, hashes = self.cache.match(req.tokens, req.reusable // P, req.cache_root)
        req.page_table, req.page_hashes, req.cached_len = pages, hashes, len(pages) * P
        if self.cache.snapshots is not None:
            req.snapshot_points = self.snapshot_points(req)
        # Count before taking: a page taken from the cached ones forgets its prefix, so taking
        # pages for a request that then does not fit would wipe the prefix cache for nothing.
        need = -(-(req.cached_len + self.chunk(req, budget)) // P) - len(pages)
        if need > len(self.cache.pool.free) + self.cache.cached_pages:
            self.free_pages(req)
            return False
        self.cache.hit_tokens += req.cached_len
        if req.prompt_cached is None:   # readmitted after a preemption, it found its own pages: not counted
            req.prompt_cached = req.cached_len
            req.admitted = time.perf_counter()
        self.grow(req, req.cached_len + self.chunk(req, budget))
        if self.states is not None:            # hybrid: its linear layers' states, held while it runs
            req.state_slot = self.states.take()
            if req.cached_len:                 # a prefix hit: its states after the prefix, from the snapshot
                self.cache.snapshots.restore(hashes[-1], req.state_slot)
        return True

    def chunk(self, req: Request, budget: int) -> int:
        """How many of req's tokens the next step computes: as many as the budget allows, but never past
        its next snapshot point (a hybrid model's states can only be copied where a chunk ends)."""
        n = min(req.uncomputed + len(req.drafts), budget)   # drafts: verified beside its last token
        stop = next((p for p in req.snapshot_points if p > req.cached_len), None)
        return n if stop is None else min(n, stop - req.cached_len)

    def snapshot_points(self, req: Request) -> list[int]:
        """Page boundaries past its hit where a hybrid model's request leaves a snapshot of its states
        (Engine._remember_full_pages): the end of its prompt's last full page before its last token
        (a later prompt that repeats or extends this one resumes there), and the end of the cached
        prefix it shares with an earlier request, when that prefix had no snapshot (a shared system
        prompt: the next request that shares it gets a hit). Two copies of the states at most."""
        P = self.page_size
        shared = len(self.cache.lookup(req.tokens, (len(req.tokens) - 1) // P, req.cache_root)) * P
        last = (len(req.prompt_ids) - 1) // P * P
        return sorted({p for p in (shared, last) if p > req.cached_len})

    def make_room(self, req: Request, positions: int) -> list[Request]:
        """Pages for req's first `positions` positions. When the pool is full, the most recently
        admitted running request is preempted (its pages freed, itself back at the front of the
        queue, to be recomputed later from whatever prefix is still cached), again until req
        fits; that may be req itself. The requests preempted, in order."""
        victims = []
        while not self.grow(req, positions):
            victim = self.running[-1]
            self.preempt(victim)
            victims.append(victim)
            if victim is req:
                break
        return victims

    def room_for(self, req: Request, positions: int) -> bool:
        """Whether req's table can cover `positions` from free or cached pages, without preempting anyone."""
        need = -(-positions // self.page_size) - len(req.page_table)
        return need <= len(self.cache.pool.free) + self.cache.cached_pages

    def grow(self, req: Request, positions: int) -> bool:
        """Add pages to req's table until it covers `positions`; False (keeping what it took) when none is left."""
        while len(req.page_table) * self.page_size < positions:
            page = self.cache.take_page()
            if page is None:
                return False
            req.page_table.append(page)
        return True

    def preempt(self, req: Request):
        self.running.remove(req)
        self.free_pages(req)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def free_pages(self, req: Request):
        """Give back every page of req at once (cached ones stay reusable by the prefix cache).

        Last page first: the LRU queue then evicts the end of a prefix before its beginning, and
        a prefix without its first page could never be matched again."""
        for page in reversed(req.page_table):
            self.cache.release(page)
        req.page_table, req.page_hashes, req.cached_len, req.drafts = [], [], 0, []
        if req.state_slot is not None:         # its states go with its pages: recomputed from position 0
            self.states.release(req.state_slot)
            req.state_slot = None

    def roll_back(self, req: Request, cached_len: int):
        """Speculative decoding refused some drafts: req keeps the keys/values of its first cached_len
        positions; the pages past the one its next token goes to held only refused drafts, and go back."""
        req.cached_len = cached_len
        keep = -(-(cached_len + 1) // self.page_size)
        for page in reversed(req.page_table[keep:]):
            self.cache.release(page)
        del req.page_table[keep:]

    def finish(self, req: Request):
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.free_pages(req)
