"""The engine: many requests at once over one model, one packed forward pass per step.

    engine = Engine(llm)
    rid = engine.add_request("The capital of France is", npqwen.SamplingParams(max_new_tokens=20, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, repr(out.text), out.finish_reason)

A step: the scheduler picks (request, n tokens) pairs under the token budget and gives them
pages; their tokens are packed into one Batch and run through the model once (every matmul
sees all of them); each request whose last known token was in the batch samples its next
token from its own logits row with its own random generator (under its constraint's mask, if it
has one: structured.py); finished requests give their pages back at once, and the next step can
admit a waiting request in their place. Prefill-only requests (embeddings, rerank scores:
prefill_only.py) ride in the same batches and never sample.
"""
import dataclasses
import itertools
import math

import numpy as np

from ..backend import free_memory_bytes, to_numpy
from ..checks import check_token_ids
from ..embed import POOLING_MODES, InputTooLong
from ..errors import NpqwenError
from ..generate import StopStrings
from ..hooks import SPECULATIVE, Hooks, residual_width
from ..kv_cache import Batch, KVCache, LinearStates, check_kv_dtype
from ..model import check_lm_head
from ..ops import SCORES_BYTES
from ..mtp import load_mtp
from ..parallel import rank_0_leads
from ..sampling import candidates, draw, score_rows
from ..sampling import logprobs as sampling_logprobs
from ..sampling_params import SamplingParams, params_of
from ..features import batch_feature_edits, check_feature_edits, edits_key
from ..speculative import accept_or_replace, propose_ngram
from ..steering import batch_steering, check_steering, prefix_key
from ..structured import ConstraintFailed, Masks, build_constraint
from .pages import PagePool
from .prefill_only import PrefillRows
from .prefix_cache import PrefixCache
from .prefix_disk import DiskPages, model_key
from .request import Request, StepOutput
from .scheduler import Scheduler
from .state_slots import StateSlots
from .state_snapshots import StateSnapshots
from .step_log import scheduled
from .thinking import thinking_budget

DEFAULT_PAGE_SIZE = 256        # positions per page; see ops.paged_attention for why pages are large
DEFAULT_STATE_SNAPSHOTS = 16   # hybrid models: snapshots of the linear layers' states kept for prefix hits
KV_MEMORY_SHARE = 0.5          # default KV pool: this share of the memory free when the engine starts, less scratch
DEFAULT_PREFIX_CACHE_DIR_GB = 16.0   # prefix_cache_dir: the most its files take, least recently used evicted first


class Engine:
    # Under tensor parallelism the engine lives on rank 0 (npqwen/parallel.py): on the other ranks
    # each @rank_0_leads method runs rank 0's forward passes, then returns rank 0's result.
    @rank_0_leads
    def __init__(self, llm, kv_cache_tokens: int | None = None, page_size: int = DEFAULT_PAGE_SIZE,
                 max_batch_size: int = 64, max_batched_tokens: int = 512, prefix_cache: bool = True,
                 state_snapshots: int = DEFAULT_STATE_SNAPSHOTS, record_steps: bool = False,
                 kv_cache_dtype: str = "auto", prefix_cache_dir=None,
                 prefix_cache_dir_size: float = DEFAULT_PREFIX_CACHE_DIR_GB, hooks=None):
        self.llm, self.model, self.config = llm, llm.model, llm.config
        check_kv_dtype(kv_cache_dtype)
        # speculative decoding's hooks ({name: fn}, npqwen/hooks.py SPECULATIVE): each request's drafts, its rows of
        # the verification, and which drafts it kept, called as fn(array, name); None: none
        self.hooks = None if hooks is None else Hooks(hooks, self.config, known=SPECULATIVE)
        for name, value, least in (("page_size", page_size, 1), ("max_batch_size", max_batch_size, 1),
                                   ("max_batched_tokens", max_batched_tokens, 1),
                                   ("state_snapshots", state_snapshots, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise NpqwenError(f"{name} must be an integer >= {least}, got {value!r}")
        # a position's keys and values in the full-attention layers only, as stored (kv_cache_dtype)
        per_token = max(1, KVCache.bytes_per_token(self.config, self.model.dtype, kv_cache_dtype))
        hybrid = getattr(self.config, "hybrid", False)   # Qwen3.5: a state per request beside the pages
        # and, for its prefix cache, snapshots of those states at the end of cached prefixes (state_snapshots.py)
        snapshots = state_snapshots if hybrid and prefix_cache else 0
        states = LinearStates.bytes_per_slot(self.config, self.model.dtype) * (max_batch_size + snapshots) \
            if hybrid else 0
        # The default pool: a share of the memory free now (the weights are loaded already) once a step's scratch
        # is set aside, so that a prompt the pool admits never takes the process past what is free; and no more
        # than a full batch of full contexts.
        if kv_cache_tokens is None:
            scratch, free = step_scratch_bytes(self.config, max_batched_tokens, max_batch_size), \
                free_memory_bytes(self.model.xp)
            fits = (int((free - scratch) * KV_MEMORY_SHARE) - states) // per_token
            kv_cache_tokens = min(fits, max_batch_size * self.config.max_position_embeddings)
            if kv_cache_tokens < page_size:
                raise NpqwenError(f"{free / 2**30:.2f} GiB is free, less a step's scratch of {scratch / 2**30:.2f} "
                                  f"GiB: no room for a KV pool of even one page; free memory, lower "
                                  f"max_batched_tokens, or give kv_cache_tokens")
        if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int) or kv_cache_tokens < page_size:
            raise NpqwenError(f"kv_cache_tokens must be an integer >= page_size ({page_size}), got {kv_cache_tokens!r}")
        self.page_size = page_size
        self.kv = KVCache(self.config, kv_cache_tokens // page_size, page_size, self.model.xp, self.model.dtype,
                          getattr(self.model, "kv_heads", None),   # this rank's heads (a stand-in model: all)
                          num_slots=max_batch_size if hybrid else 1,
                          linear_heads=getattr(self.model, "linear_heads", None),   # ... of the linear layers
                          kv_dtype=kv_cache_dtype)
        self.pool = PagePool(self.kv.num_pages)
        # A hybrid model's prefix hit also needs its linear layers' states at the end of the shared prefix:
        # without snapshots of them (state_snapshots=0) it has no prefix cache.
        # tensor parallel: what rank 0 does to the linear layers' states between batches (copies to and from the
        # snapshots, speculative roll-backs), logged for the other ranks to do to theirs before the next batch
        self.kv.state_copies = [] if hybrid and self.llm.comm.size > 1 else None
        if snapshots:   # (tensor parallel: this rank's heads)
            self.kv.snapshots = LinearStates(self.config, snapshots, self.model.xp, self.model.dtype,
                                             getattr(self.model, "linear_heads", None))
        snapshot_pool = StateSnapshots(self.kv.states, self.kv.snapshots, self.kv.state_copies) if snapshots else None
        self.cache = PrefixCache(self.pool, page_size, enabled=prefix_cache and (snapshots > 0 or not hybrid),
                                 snapshots=snapshot_pool,
                                 disk=self._disk_tier(prefix_cache_dir, prefix_cache_dir_size, kv_cache_dtype,
                                                      prefix_cache, hybrid))
        self.states = StateSlots(max_batch_size) if hybrid else None
        self.scheduler = Scheduler(self.cache, max_batch_size, max_batched_tokens, self.states)
        self.requests: dict[str, Request] = {}       # unfinished requests by id
        self.last_batch: Batch | None = None         # what the last step ran, for a reader (docs/engine.md, 3)
        self.step_log: list | None = [] if record_steps else None   # per step, who ran with how many tokens
        self.masks = Masks(self.config.vocab_size)   # constrained rows' masks, filled beside the forward pass
        self._ids = itertools.count()
        self._mtp = None                             # the MTP head (npqwen/mtp.py), read when a request asks for it
        # speculative decoding's counts, vLLM's spec_decode_* metrics: verifications, drafts, drafts kept
        self.spec_decode = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}

    def _disk_tier(self, folder, size_gb, kv_dtype: str, prefix_cache: bool, hybrid: bool) -> DiskPages | None:
        """The prefix cache's pages kept in `folder` (prefix_disk.py), at most size_gb GB of them; None: none."""
        if folder is None:
            return None
        if isinstance(size_gb, bool) or not isinstance(size_gb, (int, float)) or not size_gb > 0:
            raise NpqwenError(f"prefix_cache_dir_size must be a number of GB > 0, got {size_gb!r}")
        if not prefix_cache:
            raise NpqwenError("prefix_cache_dir needs the prefix cache; leave prefix_cache on (no --no-prefix-cache)")
        if hybrid:
            raise NpqwenError("prefix_cache_dir does not serve hybrid models (Qwen3.5) yet: their prefix hits also "
                              "need the linear layers' state snapshots, which are not written to disk; leave it unset")
        if self.llm.comm.size > 1:
            raise NpqwenError("prefix_cache_dir does not run under tensor parallelism yet (each rank holds its own "
                              "heads' keys); leave it unset")
        return DiskPages(folder, model_key(self.llm, kv_dtype, self.page_size), self.kv, int(size_gb * 1e9))

    @rank_0_leads
    def add_request(self, prompt, params: SamplingParams | int | None = None, steering=None, *,
                    lora: str | None = None, feature_edits=None, **sampling) -> str:
        """Queue a prompt (text, used as is, or token ids) to generate from as `params` (an
        npqwen.SamplingParams) say, or its fields given as keyword arguments (max_new_tokens=20,
        temperature=0, ...); its request id. `steering`, a list of {layer, vector, scale}, adds
        scale * vector to this request's residual stream after block layer (npqwen/steering.py); `lora`
        names a loaded LoRA adapter (llm.load_lora) that this request's rows go through; `feature_edits`, a
        list of {sae, feature, clamp|zero|scale}, sets an SAE feature's activation on this request's rows
        (npqwen/features.py). Everything is checked now."""
        return self.add(self.new_request(prompt, params_of(params, sampling, self.add_request), steering=steering,
                                         lora=lora, feature_edits=feature_edits))

    def new_request(self, prompt, params: SamplingParams | int | None = None, steering=None, *,
                    lora: str | None = None, feature_edits=None,
                    **sampling) -> Request:
        """A checked Request, not queued yet (see add); `params` or `sampling` as for add_request (an int
        in params' place is max_new_tokens). The values were checked when the SamplingParams was made;
        here its unset sampling values take the checkpoint's (generation_config.json), and what needs
        this model is checked: the prompt's ids, room in the context and the pool (fit), the constraint
        against the tokenizer."""
        params = params_of(params, sampling, self.new_request).with_defaults(self.llm.generation_defaults)
        steers = check_steering(steering, self.config)
        edits = check_feature_edits(feature_edits, self.config)
        keys = (prefix_key(steers), edits_key(edits))   # edited keys/values are their own in the prefix cache
        adapter = None if lora is None else self.llm.lora_adapter(lora)   # the LoraAdapter travels with the request
        ids = self.llm.prompt_ids(prompt)
        max_new_tokens = self.fit(ids, params.max_new_tokens)
        if params.speculative is not None and params.speculative.method == "mtp" and self.llm.comm.size > 1:
            # refused, not wrong: the MTP head is whole on rank 0 only (the other ranks hold no part of it)
            raise NpqwenError("speculative method \"mtp\" does not run under tensor parallelism yet (the MTP head "
                              "is not split across the ranks); use method \"ngram\", or run on one process")
        if self.config.qwen4_exp and params.speculative is not None and params.speculative.method == "mtp":
            raise NpqwenError("Qwen4-Exp: speculative method \"mtp\" is not implemented for it: its MTP head (mtp.* "
                              "weights) is ignored by transformers, so there is no reference forward to check one "
                              "against; use method \"ngram\"")
        if params.speculative is not None and params.speculative.method == "mtp":
            self.mtp_head()   # a checkpoint without the head says so now
        tokenizer = self.llm.tokenizer
        constraint = build_constraint(tokenizer, self.config.vocab_size, self.llm.eos_token_ids, params.constraint,
                                      params.thinking, ids)
        return Request(f"req-{next(self._ids)}", ids, max_new_tokens, params, frozenset(self.llm.eos_token_ids),
                       StopStrings(params.stop), tokenizer.stream_decoder() if tokenizer is not None else None,
                       params.logprobs, prompt_logprobs=params.prompt_logprobs, constraint=constraint,
                       steering=steers, feature_edits=edits, steering_key=None if keys == (None, None) else
                       hash(keys) if edits else keys[0], lora=adapter,
                       thinking=thinking_budget(params, max_new_tokens, tokenizer, ids))

    def fit(self, ids: list[int], max_new_tokens: int) -> int:
        """The checks a generation needs of this model and pool: an lm_head, a prompt that is not empty
        and leaves room in the context and the pool; max_new_tokens capped to the room left in both."""
        check_lm_head(self.model)   # a checkpoint saved without lm_head (Qwen3Model) cannot generate: say so now
        if not ids:
            raise NpqwenError("the prompt is empty")
        context = self.config.max_position_embeddings
        if len(ids) >= context:
            raise NpqwenError(f"the prompt has {len(ids)} tokens but the context holds {context} "
                              f"(max_position_embeddings): no room to generate; shorten the prompt")
        # Pages are taken as tokens come (the scheduler admits by the prompt and grows, preempting the
        # youngest request when the pool is full, as vLLM does), so only the prompt must fit now. The answer
        # stops where the whole pool is full: then a request that runs alone ends with "length", and since
        # each request fits the pool alone, the oldest one always makes progress.
        positions = self.pool.num_pages * self.page_size
        if len(ids) >= positions:
            raise NpqwenError(f"a prompt of {len(ids)} tokens needs {len(ids) // self.page_size + 1} KV pages of "
                              f"{self.page_size} positions (with one position to generate), but the pool has "
                              f"{self.pool.num_pages} ({positions} positions); shorten the prompt or give the "
                              f"engine a larger kv_cache_tokens")
        return min(max_new_tokens, context - len(ids), positions - len(ids))

    @rank_0_leads
    def new_embedding_request(self, prompt, pooling: str = "lasttoken") -> Request:
        """A prefill-only request whose output (StepOutput.embedding) is its pooled final-norm hidden
        state: "lasttoken", "mean" or "cls" (npqwen/embed.py; mean and CLS compute every position)."""
        if pooling not in POOLING_MODES:
            raise NpqwenError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {pooling!r}")
        return self._prefill_only_request(prompt, task="embed", pooling=pooling, prefix_reuse=pooling == "lasttoken")

    @rank_0_leads
    def new_scoring_request(self, prompt, token_ids) -> Request:
        """A prefill-only request whose output (StepOutput.scores) is the logits of `token_ids` at its
        last position, and nothing else of the vocabulary (the reranker's "no" and "yes")."""
        ids = check_token_ids(list(token_ids), self.config.vocab_size).tolist() if len(token_ids) else []
        if not ids:
            raise NpqwenError("token_ids must name at least one token to score")
        check_lm_head(self.model)   # a checkpoint without lm_head says so now, not in a step
        return self._prefill_only_request(prompt, task="score", score_ids=tuple(ids))

    def _prefill_only_request(self, prompt, **fields) -> Request:
        ids = self.llm.prompt_ids(prompt)
        if not ids:
            raise NpqwenError("the prompt is empty")
        context = self.config.max_position_embeddings
        if len(ids) > context:
            raise InputTooLong(f"the prompt has {len(ids)} tokens but the context holds {context} "
                               f"(max_position_embeddings); shorten it")
        need = math.ceil(len(ids) / self.page_size)
        if need > self.pool.num_pages:
            raise InputTooLong(f"a prompt of {len(ids)} tokens needs {need} KV pages of {self.page_size} positions, "
                              f"but the pool has {self.pool.num_pages}; give the engine a larger kv_cache_tokens")
        return Request(f"req-{next(self._ids)}", ids, 0, SamplingParams(), frozenset(), StopStrings(None), **fields)

    def add(self, req: Request) -> str:
        """Queue a request made by new_request; its id."""
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    @rank_0_leads
    def step(self) -> list[StepOutput]:
        """Run one scheduling step; one output per request that advanced, in the order of its sequences
        in the step's Batch (self.last_batch), then one per probe that ended (its last token ran alone,
        Engine._probe_pass)."""
        for req in self.scheduler.running:   # speculative decoding, 1. propose: drafts after its last token
            req.drafts = self.hooked_drafts(self.propose(req))
        plan = self.scheduler.schedule()
        planned = dict(plan)                 # drafts the budget left out (or of a request preempted) are dropped
        for req in self.scheduler.running:
            req.drafts = req.drafts[:max(0, planned.get(req, 0) - req.uncomputed)]
        if self.step_log is not None:   # record_steps: the plan as rows (step_log.py); nothing else changes
            self.step_log.append(scheduled(plan))
        plan, probes = hold_back_probes(plan)   # a probe's last token runs alone, after the batch
        if not plan:
            return [self._probe_pass(req) for req in probes]
        # 1. pack: each request's next n tokens, its cached length and its pages
        samples = [req.cached_len + n == len(req.tokens) + len(req.drafts) and req.task is None   # its last known
                   for req, n in plan]                                                        # token is in?
        lengths = [n for _, n in plan]
        ends = np.cumsum(lengths)
        scoring = [prompt_rows(req, n, end - n) for (req, n), end in zip(plan, ends)]   # rows scoring a prompt token
        # a sampling request's last row, and with drafts (2. verify) the rows of its last token and each draft
        sampling = np.concatenate([np.arange(end - 1 - len(req.drafts), end) for (req, _), end, sample
                                   in zip(plan, ends, samples) if sample] or [[]]).astype(np.int64)
        rows = np.sort(np.concatenate([sampling, *scoring])).astype(np.int64)
        prefill_only = PrefillRows(plan, ends)   # the rows embeddings and scores read instead of sampling
        # speculative method "mtp": the MTP head drafts from the final-norm states of every position computed
        mtp_rows = [np.arange(end - n, end) for (req, n), end in zip(plan, ends) if drafts_by_mtp(req)]
        hidden_rows = prefill_only.batch_fields.pop("hidden_rows")
        mtp_first = len(hidden_rows)                # its states follow the embeddings' in the step's hidden states
        hidden_rows = np.concatenate([hidden_rows, *mtp_rows]).astype(np.int64)
        batch = Batch(np.array([t for req, n in plan for t in (req.tokens[req.cached_len:] + req.drafts)[:n]]),
                      starts=[req.cached_len for req, _ in plan], lengths=lengths,
                      page_tables=[np.array(req.page_table) for req, _ in plan], page_size=self.page_size,
                      sample_rows=rows, loras=[req.lora for req, _ in plan],
                      state_slots=[req.state_slot for req, _ in plan], hidden_rows=hidden_rows,
                      **prefill_only.batch_fields,
                      verify=[bool(req.drafts) for req, _ in plan],
                      steering=batch_steering([(req.steering, end - n, n) for (req, n), end in zip(plan, ends)
                                               if req.steering], int(ends[-1]), residual_width(self.config),
                                              self.model.xp, self.model.dtype),
                      feature_edits=batch_feature_edits([(req.feature_edits, end - n, n)
                                                         for (req, n), end in zip(plan, ends) if req.feature_edits]))
        self.last_batch = batch
        # 2. one forward pass for all of them; logits only for the rows that sample (or score their prompt).
        # A constrained row's mask depends only on tokens drawn in earlier steps, so a worker thread fills
        # this step's masks while the forward pass runs (structured.Masks); sampling below waits for them.
        self.masks.start([req.constraint for (req, _), s in zip(plan, samples) if s and req.constraint])
        computed = self.model.forward_batch(batch, self.kv)                           # model.BatchOutput
        logits = to_numpy(computed.logits)                                            # (sampling requests, V)
        logits, prompt_scores = self._score_prompts(plan, scoring, rows, logits, sampling)
        # 3. each request takes its tokens' keys/values as computed and, if its turn, samples
        outputs, row = [], 0
        mtp_states = to_numpy(computed.hidden[mtp_first:]) if mtp_rows else None   # (rows of mtp requests, D)
        for (req, n), sample in zip(plan, samples):
            if drafts_by_mtp(req):   # the states of this step's positions, for the MTP head's next drafts
                req.mtp_hidden.update(zip(range(req.cached_len, req.cached_len + n), mtp_states[:n]))
                mtp_states = mtp_states[n:]
            if req.drafts:   # speculative decoding, 3. accept and 4. roll back
                outputs.append(self.accept(req, logits[row:row + n]))
                row += n
                if req.finished:
                    self._finish(req)
                continue
            req.cached_len += n
            self._remember_full_pages(req)
            if req.task is not None:   # prefill-only: its rows folded in; finished once the prompt is read
                outputs.append(self._finish_if(prefill_only.output(req, computed)))
                continue
            if not sample:
                outputs.append(StepOutput(req.request_id, [], ""))
                continue
            row_logits, row = logits[row], row + 1
            try:
                forced = req.thinking.forced() if req.thinking is not None else None   # its thinking budget is spent
                # None for a free request; waited for even when the token is forced, since the mask worker may
                # still be reading the matcher that req.append advances (llguidance: "Already borrowed")
                allowed = self.masks.allowed(req.constraint) if forced is None else self.masks.wait()
                ids, candidate_logits = candidates(no_eos_yet(req, row_logits, allowed), req.params, req.prompt_ids,
                                                   req.output_ids, allowed)
                token = draw(ids, candidate_logits, req.params, req.rng) if forced is None else forced
                out = req.append(token)
            except ConstraintFailed as e:   # llguidance failed on this request: it ends, the others go on
                outputs.append(self._fail(req, str(e)))
                continue
            if req.logprobs is not None:
                out.logprobs = [sampling_logprobs(ids, candidate_logits, token, req.logprobs)]
            outputs.append(out)
            if req.finished:
                self._finish(req)
        for i, scores in prompt_scores.items():   # one output per request of the plan, in its order
            outputs[i].prompt_logprobs = scores
        return outputs + [self._probe_pass(req) for req in probes]

    def propose(self, req: Request) -> list[int]:
        """Speculative decoding, 1. propose: the drafts a decoding request guesses after its last token
        (speculative.py); [] for a request that does not speculate, or whose draws the engine steers
        token by token (a constraint, a thinking budget), or with no room left for a draft."""
        spec = req.params.speculative
        if spec is None or req.uncomputed != 1 or req.constraint is not None or req.thinking is not None \
                or req.probe is not None or req.task is not None:
            return []
        k = min(spec.k, req.max_new_tokens - len(req.output_ids) - 1)   # the step's own token comes on top
        if k <= 0:
            return []
        if spec.method == "ngram":
            return propose_ngram(req.tokens, k, spec.prompt_lookup_max, spec.prompt_lookup_min)
        return self.mtp_drafts(req, k)

    def accept(self, req: Request, logits: np.ndarray) -> StepOutput:
        """Speculative decoding, 3. accept: logits (1 + drafts, V) are the rows of req's last token and of each
        draft (2. verify, the step's forward pass). Row i's distribution keeps draft i or replaces it
        (speculative.accept_or_replace); the first replaced draft ends it, and after the last kept draft its
        row gives one more token. 4. roll back: the keys/values and linear-attention states of its last token and
        the kept drafts stay, those of the refused ones go (Scheduler.roll_back, LinearStates.roll_back)."""
        start, drafts = req.cached_len, req.drafts
        if self.hooks is not None:   # the verification's rows, as a hook sees (and may change) them
            logits = self.hooks("speculative.verify", logits)
        tokens, text, logprobs, kept = [], "", [], 0
        for i, row_logits in enumerate(logits):
            draft = drafts[i] if i < len(drafts) else None
            ids, candidate_logits = candidates(no_eos_yet(req, row_logits), req.params, req.prompt_ids, req.output_ids)
            token, accepted = accept_or_replace(ids, candidate_logits, draft, req.params.greedy, req.rng,
                                                lambda ids_, logits_, rng: draw(ids_, logits_, req.params, rng))
            out = req.append(token)
            tokens.append(token)
            text += out.text
            if req.logprobs is not None:
                logprobs.append(sampling_logprobs(ids, candidate_logits, token, req.logprobs))
            kept += accepted
            if not accepted or req.finished:
                break
        self.spec_decode["num_drafts"] += 1
        self.spec_decode["num_draft_tokens"] += len(drafts)
        self.spec_decode["num_accepted_tokens"] += kept
        if self.hooks is not None:   # which drafts it kept: the first `kept` (read only)
            self.hooks("speculative.accept", np.arange(len(drafts)) < kept)
        req.drafts = []
        self.scheduler.roll_back(req, start + 1 + kept)
        if req.state_slot is not None:
            self.kv.states.roll_back(req.state_slot, 1 + kept)
            if self.kv.state_copies is not None:   # tensor parallel: the other ranks roll theirs back too
                self.kv.state_copies.append(("roll_back", req.state_slot, 1 + kept))
        self._remember_full_pages(req)
        if self.step_log is not None:   # the recorder's row of this request: how many of its drafts it kept
            self.step_log[-1] = [dataclasses.replace(r, accepted_tokens=kept) if r.request_id == req.request_id
                                 else r for r in self.step_log[-1]]
        return StepOutput(req.request_id, tokens, text, req.finished, req.finish_reason,
                          req.result() if req.finished else None, logprobs=logprobs if req.logprobs is not None
                          else None, drafts=list(drafts))

    def hooked_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts as the hooks on speculative.propose leave them (a hook may replace them: same length)."""
        if self.hooks is None or not drafts:
            return drafts
        new = self.hooks("speculative.propose", np.array(drafts, dtype=np.int64))
        if ((new < 0) | (new >= self.config.vocab_size)).any():
            raise NpqwenError(f"a hook on speculative.propose returned drafts outside the vocabulary "
                              f"[0, {self.config.vocab_size}): {new.tolist()}")
        return [int(t) for t in new]

    def mtp_drafts(self, req: Request, k: int) -> list[int]:
        """k drafts from Qwen3.5's MTP head (npqwen/mtp.py): the positions computed since the last call are
        fed to its own cache (each position's final-norm state and the token after it), then it runs k
        times in a chain from the last one; the chained positions are not kept."""
        head = self.mtp_head()
        if req.mtp_cache is None:
            req.mtp_cache = head.new_cache(len(req.prompt_ids) + req.max_new_tokens + 64)
        cache = req.mtp_cache
        start, end = cache.length, req.cached_len   # positions computed but not fed (the refused drafts' are gone)
        if any(p not in req.mtp_hidden for p in range(start, end)) or end <= start:
            return []
        states, logits = head.forward(np.stack([req.mtp_hidden[p] for p in range(start, end)]),
                                      req.tokens[start + 1:end + 1], cache)   # the last row guesses token end + 1
        req.mtp_hidden.clear()
        return head.chain(to_numpy(states[-1]), int(np.argmax(to_numpy(logits[-1]))), cache, k)

    def mtp_head(self):
        """Qwen3.5's MTP head, read from the checkpoint the first time a request asks for it."""
        if self._mtp is None:
            self._mtp = load_mtp(self.llm.path, self.model)
        return self._mtp

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
                "prefix_cache_hit_tokens": self.cache.hit_tokens, "preemptions": self.scheduler.preemptions,
                "prefix_cache_disk_pages_read": self.cache.disk.loaded_pages if self.cache.disk else 0,
                "prefix_cache_disk_pages_written": self.cache.disk.saved_pages if self.cache.disk else 0,
                "state_snapshots": len(self.cache.snapshots.by_hash) if self.cache.snapshots is not None else 0,
                **{f"spec_decode_{name}": count for name, count in self.spec_decode.items()}}

    @rank_0_leads
    def check(self):
        """The page bookkeeping invariants (see PagePool.check), the prefix cache's (with a hybrid model's state
        snapshots) and the state slots'; the tests call it after every step."""
        self.pool.check([r.page_table for r in self.scheduler.running] + [r.page_table for r in self.scheduler.waiting],
                        self.cache.unused)
        self.cache.check()
        if self.states is not None:   # hybrid: one state slot per running request, none for a waiting one
            self.states.check([r.state_slot for r in self.scheduler.running])
            if any(r.state_slot is not None for r in self.scheduler.waiting):
                raise NpqwenError("a waiting request holds a state slot")
        # speculative decoding: between steps no request holds drafts and no verification's states are left
        if any(r.drafts for r in self.scheduler.running + list(self.scheduler.waiting)):
            raise NpqwenError("a request holds drafts between steps: its verification was not accepted")
        if self.kv.states is not None and (self.kv.states.verified or self.kv.states.ple_verified):
            raise NpqwenError(f"linear-attention (or PLE) states of verifications not rolled back: slots "
                              f"{sorted({*self.kv.states.verified, *self.kv.states.ple_verified})}")
        for req in self.scheduler.running + list(self.scheduler.waiting):   # a preempted one keeps its matcher
            if req.constraint is not None:
                req.constraint.check(len(req.output_ids))

    def _score_prompts(self, plan, scoring, rows, logits, sample_rows) -> tuple:
        """(the sampling rows' logits, {plan index: prompt logprobs}): requests that score their
        prompt (Request.prompt_logprobs) had every prompt position of their chunk in the batch's
        logit rows, so a long prompt is scored a chunk per step, never as one (T, V) array."""
        if len(rows) == len(sample_rows):   # nobody scores: the rows are the sampling rows
            return logits, {}
        scores = {}
        for i, ((req, _), mine) in enumerate(zip(plan, scoring)):
            if len(mine):
                targets = req.prompt_ids[req.prompt_scored:req.prompt_scored + len(mine)]
                scores[i] = score_rows(logits[np.searchsorted(rows, mine)], targets, req.prompt_logprobs)
                req.prompt_scored += len(mine)
        return logits[np.searchsorted(rows, sample_rows)], scores

    def _probe_pass(self, req: Request) -> StepOutput:
        """A probe's last token, run alone with the probe's recorder, which keeps what it wants of that
        token's steps (the web page's attention weights of a layer, a Qwen3-MoE router's choices); then
        the probe ends. Its prompt went through the batches a chunk at a time like any other, so while
        a 2048-token probe runs every stream keeps getting a token per step."""
        p = req.cached_len
        batch = Batch(np.array(req.tokens[p:p + 1]), starts=[p], lengths=[1], page_tables=[np.array(req.page_table)],
                      page_size=self.page_size, sample_rows=np.array([0]), loras=[req.lora],
                      state_slots=[req.state_slot])
        self.model.forward_batch(batch, self.kv, req.probe)
        req.cached_len += 1
        self._remember_full_pages(req)
        req.finish_reason = "stop"
        self._finish(req)
        return StepOutput(req.request_id, [], "", True, "stop", req.result())

    def _remember_full_pages(self, req: Request):
        """Pages filled by this step become known to the prefix cache (chain hash of the tokens up to their end);
        a hybrid model's request whose chunk ended at one of its snapshot points leaves a copy of its states
        there, under the hash of the page it filled last."""
        P = self.page_size
        while len(req.page_hashes) < req.cached_len // P:
            j = len(req.page_hashes)
            parent = req.page_hashes[-1] if req.page_hashes else req.cache_root
            req.page_hashes.append(self.cache.register(req.page_table[j], parent, req.tokens[j * P:(j + 1) * P]))
            if self.cache.disk is not None and req.cache_root is None:   # and to the disk tier (prefix_disk.py)
                key = self.cache.disk.keys(req.tokens, j + 1, P)[-1]
                self.cache.disk.save(key, req.page_table[j], req.tokens[j * P:(j + 1) * P])
        if req.cached_len in req.snapshot_points:
            self.cache.snapshots.save(req.page_hashes[req.cached_len // P - 1], req.state_slot)

    def _finish_if(self, out: StepOutput) -> StepOutput:
        if out.finished:
            self._finish(self.requests[out.request_id])
        return out

    def _finish(self, req: Request):
        self.scheduler.finish(req)
        del self.requests[req.request_id]

    def _fail(self, req: Request, message: str) -> StepOutput:
        """End a request that cannot go on (its constraint failed): finish_reason "error", the message in
        its result; LLM.generate raises it, the server answers 500, a batch file records it."""
        req.finish_reason, req.error = "error", message
        self._finish(req)
        return StepOutput(req.request_id, [], "", True, "error", req.result())


def step_scratch_bytes(config, max_batched_tokens: int, max_batch_size: int) -> int:
    """The most a step holds besides the weights and the KV pool, in float32 (an upper estimate): a chunk's
    activations, bounded by max_batched_tokens, not by the prompt (each layer's x, qkv, q/k after norm and
    rotation, the attention output, gate_up, its activation and product, a few of each); one block of attention
    scores and its softmax (ops.SCORES_BYTES); the sampled rows' logits and their sampling copies."""
    D, F = config.hidden_size, max(config.intermediate_size, getattr(config, "moe_intermediate_size", 0) or 0)
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_token = 6 * F + 12 * D + 4 * qkv
    return 4 * (max_batched_tokens * per_token + 3 * max_batch_size * config.vocab_size) + 2 * SCORES_BYTES


def drafts_by_mtp(req: Request) -> bool:
    return req.params.speculative is not None and req.params.speculative.method == "mtp" and req.task is None


def hold_back_probes(plan: list) -> tuple[list, list]:
    """(the plan without the last token of each probe due now, those probes): that token runs on
    its own after the batch (Engine._probe_pass)."""
    kept, probes = [], []
    for req, n in plan:
        if req.probe is not None and req.cached_len + n == len(req.tokens):
            probes.append(req)
            n -= 1
        if n:
            kept.append((req, n))
    return kept, probes


def prompt_rows(req: Request, n: int, first_row: int) -> np.ndarray:
    """Rows of a step's batch (req's n tokens start at first_row) whose logits score one of req's
    prompt tokens not scored yet: position j scores token j + 1. Empty unless it scores its prompt."""
    if req.prompt_logprobs is None:
        return np.empty(0, np.int64)
    # positions before prompt_scored - 1 scored already (after a preemption they are read again);
    # the prefix cache never supplies a position that is still to score (Request.reusable)
    lo, hi = req.prompt_scored - 1, min(req.cached_len + n, len(req.prompt_ids) - 1)
    return first_row + np.arange(lo, max(hi, lo)) - req.cached_len


def no_eos_yet(req: Request, logits: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """A request's logits row (V,), with its eos tokens made impossible while it has fewer than
    req.min_tokens tokens (vLLM's min_tokens); unless its constraint's mask `allowed` leaves nothing
    but eos, when the constraint wins (the answer is complete)."""
    if len(req.output_ids) >= req.min_tokens or not req.eos_ids:
        return logits
    if allowed is not None and not np.delete(allowed, list(req.eos_ids)).any():
        return logits
    logits = logits.copy()
    logits[list(req.eos_ids)] = -np.inf
    return logits
