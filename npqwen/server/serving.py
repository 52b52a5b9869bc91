"""The shared base of the handlers: every API (serving_*.py) is a subclass of Serving.

Serving owns what the APIs have in common: the model (its name, GET /v1/models, /health) and the
checks every body gets (its model, its size before tokenizing, its token ids, the room it leaves
to generate); building engine requests (requests: one SamplingParams of the body, then
engine_request, the one call of Engine.new_request); the one way to the engine thread (submit,
with its one 429 and Retry-After); and reading what comes back (outputs, collect, finished;
Choice, usage). The chat template and each API's JSON shapes stay in its subclass.
"""
import asyncio
import codecs
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from fastapi import Request as HTTPRequest

from ..errors import NpqwenError
from ..checks import check_token_ids
from ..model import check_lm_head
from ..sampling_params import SamplingParams
from ..features import check_feature_edits
from ..steering import check_steering
from ..structured import ConstraintError
from .engine_loop import EngineLoop, EngineStopped
from .parsers import StreamParser
from .protocol import IGNORED, APIError
from .tokenizer_process import LONG_TEXT_CHARS, TokenizerProcess

RETRY_AFTER_SECONDS = 1                    # a 429's Retry-After
DISCONNECT_POLL_SECONDS = 0.05             # how often a waiting handler checks that its client is still there
PROMPT_WORKERS = 4                         # threads that apply the chat template and tokenize (see Serving.off_loop)


class PromptWorkers:
    """Where prompts are made off the event loop: threads for the chat template and the tokenizer,
    and for a text of megabytes the tokenizer process (tokenizer_process.py). The APIs share one."""

    def __init__(self, tokenizer):
        self.threads = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="npqwen-prompt")
        self.tokenizer_process = TokenizerProcess(tokenizer) if tokenizer is not None else None
        if tokenizer is not None:   # it reads the whole vocabulary once: now, not in a request's time
            tokenizer.fewest_tokens("")

    def close(self):
        self.threads.shutdown(wait=False, cancel_futures=True)
        if self.tokenizer_process is not None:
            self.tokenizer_process.close()


class Choice:
    """One choice of an HTTP call: its engine request and what has been produced and sent of it."""

    def __init__(self, index: int, request, parser: StreamParser | None = None):
        self.index, self.request, self.parser = index, request, parser
        self.text = ""
        self.finish_reason = None
        self.logprobs = []        # (token, log p, top) not sent yet (a stream), or all of them
        self.token_ids = []       # ids sampled and not sent yet (a stream), or all of them
        self.drafts = []          # speculative decoding: per id in token_ids, {"draft": id or None, "accepted": bool}
        self.prompt_logprobs = []  # (log p, top, rank) of each prompt token after the first, when scored
        self.offsets = TextOffsets()   # completions' text_offset, across the chunks of a stream
        self.echoed = False       # a streamed echo: the prompt's chunk is out


class Serving:
    """What every API's handlers share; GET /v1/models and /health are answered by this base itself."""

    def __init__(self, llm, loop: EngineLoop, model_name: str, max_queue: int, workers: PromptWorkers,
                 template_kwargs: dict | None = None, thinking_budget: int | None = None,
                 allow_generation: bool = False, saes: dict | None = None, labels: dict | None = None):
        self.llm, self.engine, self.loop, self.workers = llm, loop.engine, loop, workers
        self.tokenizer, self.config = llm.tokenizer, llm.config
        self.model_name, self.max_queue = model_name, max_queue
        self.template_kwargs = template_kwargs or {}   # --default-chat-template-kwargs: under each request's
        self.thinking_budget = thinking_budget         # --thinking-budget: when a request sets none
        self.allow_generation = allow_generation       # --allow-generation: text from an embedding model too
        self.saes = saes or {}                         # --sae NAME=PATH: name -> SAE, for feature_edits and the page
        self.labels = labels or {}                     # --feature-labels NAME=FILE: name -> {feature: description}
        self.created = int(time.time())
        self.ignored: set[str] = set()   # OpenAI's service fields seen so far (note_ignored)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The tokenizer's ids of a text; a long one is tokenized in the tokenizer process (see there why)."""
        if len(text) > LONG_TEXT_CHARS:
            return self.workers.tokenizer_process.encode(text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def off_loop(self, fn, *args):
        """fn(*args) in a worker thread. Applying the chat template to a long conversation and
        tokenizing it take seconds for megabytes of text; on the event loop every other client's
        stream and /health would wait that long (the tokenizer lets go of the GIL while it works)."""
        return await asyncio.get_running_loop().run_in_executor(self.workers.threads, functools.partial(fn, *args))

    # -- the model --

    def models(self) -> dict:
        """GET /v1/models: the model served, and each LoRA adapter with the model as its parent (vLLM's list)."""
        return {"object": "list", "data": [self.model_card()] + [self.lora_card(n) for n in self.llm.loras]}

    def model(self, name: str) -> dict:
        """GET /v1/models/{name}."""
        self.check_model(name)
        return self.model_card() if name == self.model_name else self.lora_card(name)

    def lora_card(self, name: str) -> dict:
        return {**self.model_card(), "id": name, "root": str(self.llm.lora_adapter(name).path),
                "parent": self.model_name}

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "npqwen",
                "max_model_len": self.config.max_position_embeddings,
                "kind": self.llm.kind}   # "embedding", "reranker" or "generation": what it was made for

    def health(self) -> dict:
        """GET /health: 200 while the engine thread is alive, 503 once it has stopped."""
        if not self.loop.alive:
            raise APIError(503, "the engine thread has stopped", type="server_error")
        return {"status": "ok"}

    def version(self) -> dict:
        """GET /version, as vLLM answers it."""
        from .. import __version__
        return {"version": __version__}

    def check_model(self, name: str | None, adapters: bool = True):
        """The body's model: the one served, or (where `adapters`) one of its LoRA adapters; else a 404."""
        served = [self.model_name] + (self.llm.loras if adapters else [])
        if name is not None and name not in served:
            also = "" if adapters or name not in self.llm.loras else " here (LoRA adapters apply to generation only)"
            raise APIError(404, f"the model {name!r} does not exist{also}: this server serves "
                                f"{', '.join(map(repr, served))}", "model", "model_not_found")

    def lora_of(self, body) -> str | None:
        """The LoRA adapter a body's model names (vLLM's convention), or None for the model itself."""
        name = getattr(body, "model", None)
        return name if name is not None and name != self.model_name and name in self.llm.loras else None

    def check_tokens(self, ids: list[int], param: str = "tokens"):
        """Token ids a client sent, by the rule every prompt follows (generate.check_token_ids)."""
        try:
            check_token_ids(ids, self.config.vocab_size)
        except NpqwenError as e:
            raise APIError(400, str(e), param) from None

    # -- making engine requests --

    def check_room(self, tokens: int, max_tokens: int | None, param: str, at_least: str = "") -> int:
        """max_tokens, or when unset what the context and the KV pool leave; a 400 if the prompt's
        `tokens` (or, before tokenizing, a lower bound on them: `at_least` says so) leave no room."""
        context = self.config.max_position_embeddings
        if max_tokens is not None and tokens + max_tokens > context:
            raise APIError(400, f"this model's context is {context} tokens, but the request has {at_least}{tokens} "
                                f"prompt tokens and asks for {max_tokens} more ({tokens + max_tokens}); shorten "
                                f"the {param} or lower max_tokens", param, "context_length_exceeded")
        pool = self.engine.pool.num_pages * self.engine.page_size
        if max_tokens is not None and tokens + max_tokens > pool:
            raise APIError(400, f"this server's KV cache holds {pool} positions, but the request has "
                                f"{at_least}{tokens} prompt tokens and asks for {max_tokens} more "
                                f"({tokens + max_tokens}); shorten the {param} or lower max_tokens", param,
                           "context_length_exceeded")
        if max_tokens is None:   # as much as the context and the KV pool allow
            max_tokens = min(context, self.engine.pool.num_pages * self.engine.page_size) - tokens
            if max_tokens < 1:
                raise APIError(400, f"the {param} has {at_least}{tokens} tokens, which leaves no room to generate "
                                    f"in this server's context or KV cache; shorten it", param,
                               "context_length_exceeded")
        return max_tokens

    def check_size(self, prompt, max_tokens: int | None, param: str):
        """Refuse a prompt that cannot fit before tokenizing it, or checking its every id: a list of ids
        has its length; a long text at least Tokenizer.fewest_tokens (from its size in bytes)."""
        if not isinstance(prompt, str):
            self.check_room(len(prompt), max_tokens, param)
        elif len(prompt) > LONG_TEXT_CHARS and self.tokenizer is not None:
            fewest = self.tokenizer.fewest_tokens(prompt)
            self.check_room(fewest, max_tokens, param, f"{len(prompt)} characters, so at least ")

    def requests(self, prompt, body, max_tokens: int | None, logprobs: int | None, param: str,
                 prompt_logprobs: int | None = None, constraint: tuple[dict, str] | None = None,
                 thinking: bool = False, thinking_budget: int | None = None) -> list:
        """The n engine requests of one prompt (choices after the first follow it, sharing its pages;
        the first scores the prompt when `prompt_logprobs` is set); `constraint`: (SamplingParams'
        constraint fields, the body field they came from)."""
        self.check_size(prompt, max_tokens, param)
        if self.llm.kind == "embedding" and not self.allow_generation:
            raise APIError(400, f"{self.model_name!r} is an embedding model (so /v1/models lists it): it serves "
                                f"/v1/embeddings, not text; start the server with --allow-generation to generate "
                                f"with it anyway", "model", "model_not_supported")
        try:
            check_lm_head(self.llm.model)   # a Qwen3Model checkpoint (embeddings only) cannot generate
        except NpqwenError as e:
            raise APIError(400, str(e), "model", "model_not_supported") from None
        try:
            ids = self.encode(prompt) if isinstance(prompt, str) else self.llm.prompt_ids(prompt)
        except NpqwenError as e:
            raise APIError(400, str(e), param) from None
        if not ids:
            raise APIError(400, f"{param} is empty", param)
        max_tokens = self.check_room(len(ids), max_tokens, param)
        steering, edits = self.steering(body), self.feature_edits(body)
        constrain, constraint_param = constraint or ({}, None)
        params = self.refusing(body, "max_tokens", constraint_param, lambda: SamplingParams(
            max_new_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, thinking=thinking,
            thinking_budget=thinking_budget, **body.sampling(), **constrain))
        made = []
        for i in range(body.n):
            seed = None if body.seed is None else (body.seed + i) % 2 ** 64   # each choice its own draw
            choice = replace(params, seed=seed, prompt_logprobs=None if made else prompt_logprobs)
            req = self.engine_request(ids, choice, "max_tokens", body, constraint_param, steering, edits)
            self.vllm_options(req, body, max_tokens)
            if made:
                req.leader = made[0]
            made.append(req)
        return made

    def engine_request(self, ids: list[int], params: SamplingParams, param: str, body=None, constraint_param=None,
                       steering=(), feature_edits=()):
        """The one call of Engine.new_request; what the engine refuses is a 400 (see refusing)."""
        return self.refusing(body, param, constraint_param,
                             lambda: self.engine.new_request(ids, params, steering=steering, lora=self.lora_of(body),
                                                             feature_edits=feature_edits))

    def steering(self, body) -> tuple:
        """The body's steering, checked against the model (a 400 naming `steering`)."""
        try:
            return check_steering([s.model_dump() for s in body.steering or []], self.llm.config)
        except NpqwenError as e:
            raise APIError(400, str(e), "steering") from None

    def feature_edits(self, body) -> tuple:
        """The body's feature edits, each naming an SAE the server loaded, checked against it (a 400 naming
        `feature_edits`)."""
        items = []
        for j, item in enumerate(body.feature_edits or []):
            if item.sae not in self.saes:
                loaded = ", ".join(repr(n) for n in self.saes) or "none (start the server with --sae NAME=PATH)"
                raise APIError(400, f"feature_edits[{j}].sae {item.sae!r} is not an SAE this server loaded; it has "
                                    f"{loaded}", "feature_edits")
            items.append({**item.model_dump(exclude_none=True), "sae": self.saes[item.sae]})
        try:
            return check_feature_edits(items, self.llm.config)
        except NpqwenError as e:
            raise APIError(400, str(e), "feature_edits") from None

    @staticmethod
    def refusing(body, param: str, constraint_param: str | None, make):
        """make(), with what it refuses as a 400 naming the body's field the value came from (the first
        word of the message, when the body has such a field), else `param`; a constraint's fault names
        `constraint_param`."""
        try:
            return make()
        except ConstraintError as e:
            raise APIError(400, str(e), constraint_param) from None
        except NpqwenError as e:
            field = str(e).split(" ", 1)[0]
            known = body is not None and field in type(body).model_fields
            raise APIError(400, str(e), field if known else param) from None

    def vllm_options(self, req, body, max_tokens: int):
        """vLLM's ignore_eos, min_tokens, skip_special_tokens and include_stop_str_in_output on an engine request."""
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens {body.min_tokens} is more than max_tokens {max_tokens}", "min_tokens")
        if body.ignore_eos:
            req.eos_ids = frozenset()
        if body.stop_token_ids:   # vLLM's: these end the answer as eos does (their text left out)
            self.check_tokens(body.stop_token_ids, "stop_token_ids")
            req.eos_ids = req.eos_ids | frozenset(body.stop_token_ids)
        req.min_tokens, req.include_stop = body.min_tokens, body.include_stop_str_in_output
        if body.skip_special_tokens and self.tokenizer is not None:
            req.decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)

    def note_ignored(self, body, names: tuple = IGNORED):
        """One log line the first time each of OpenAI's service fields (store, metadata, ...) comes:
        accepted, since clients send them, but they change nothing here."""
        for name in names:
            if name in body.model_fields_set and name not in self.ignored:
                self.ignored.add(name)
                logging.getLogger("uvicorn.error").info(
                    f"npqwen: the field {name!r} is accepted and ignored (it does not change the answer)")

    # -- the engine thread, and what comes back --

    def submit(self, requests: list, together: bool = False) -> asyncio.Queue:
        """Hand the requests to the engine thread (before any response starts, so that a full queue
        is a real 429, with Retry-After); their outputs come through the queue returned. `together`:
        the inputs of one embeddings or rerank call (up to MAX_INPUTS) are one piece of work, admitted
        while the queue has room however many there are; a call's choices count one by one."""
        if not together and len(requests) > self.max_queue:   # a 429 would never succeed: clients would loop
            prompts = sum(r.leader is None for r in requests)
            many = (f"{prompts} prompts x n = {len(requests)} requests" if prompts < len(requests)
                    else f"{prompts} prompts")
            raise APIError(400, f"this call makes {many}, more than this server ever queues (--max-queue "
                                f"{self.max_queue}); send at most {self.max_queue} at a time",
                           "n" if prompts < len(requests) else "prompt", "too_many_requests")
        if self.loop.queued() + (1 if together else len(requests)) > self.max_queue:
            raise APIError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry later",
                           None, "queue_full", type="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return self.loop.submit(requests)

    async def outputs(self, queue: asyncio.Queue, requests: list, http: HTTPRequest):
        """(choice index, StepOutput) as the engine produces them, until every choice is finished;
        a client that disconnects, or a caller that stops early, aborts what is left."""
        left, next_check = len(requests), time.monotonic() + DISCONNECT_POLL_SECONDS
        try:
            while left:
                try:
                    index, item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    item = None
                if time.monotonic() >= next_check:   # checked on a clock: outputs may arrive at every step
                    next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
                    if await http.is_disconnected():
                        return
                if item is None:
                    if not self.loop.thread.is_alive():   # it stopped before taking these requests
                        raise EngineStopped("the server is shutting down")
                    continue
                if isinstance(item, Exception):
                    raise item
                left -= item.finished
                yield index, item
        finally:
            if left:
                self.loop.abort(requests)

    async def collect(self, queue: asyncio.Queue, choices: list, http: HTTPRequest) -> bool:
        """Whole answers (not streamed) into the choices; False if the client went away first."""
        async with contextlib.aclosing(self.outputs(queue, [c.request for c in choices], http)) as outputs:
            async for index, out in outputs:
                c = choices[index]
                c.text += out.text
                c.logprobs += token_logprobs(out)
                c.token_ids += out.token_ids
                c.drafts += token_drafts(out)
                c.prompt_logprobs += out.prompt_logprobs or []
                c.finish_reason = out.finish_reason
        return not await http.is_disconnected() and all(c.finish_reason is not None for c in choices)

    async def finished(self, requests: list, http: HTTPRequest, together: bool = False) -> list | None:
        """Run the requests (see submit); their final outputs in order, or None if the client went away first."""
        outs = {}
        async with contextlib.aclosing(self.outputs(self.submit(requests, together), requests, http)) as outputs:
            async for index, out in outputs:
                if out.finished:
                    outs[index] = out
        if len(outs) < len(requests) or await http.is_disconnected():
            return None
        return [outs[i] for i in range(len(requests))]

    def vllm_prompt_logprobs(self, leader: Choice) -> list:
        """vLLM's prompt_logprobs (chat and completions): None for the first token, then {id: {logprob, rank,
        decoded_token}} for the prompt's token and the most likely alternatives (their rank is their place)."""
        decode, ids = self.tokenizer.decode, leader.request.prompt_ids
        out = [None]
        for token, (lp, top, rank) in zip(ids[1:], leader.prompt_logprobs):
            entry = {str(t): {"logprob": l, "rank": i + 1, "decoded_token": decode([t])}
                     for i, (t, l) in enumerate(top)}
            entry[str(token)] = {"logprob": lp, "rank": rank, "decoded_token": decode([token])}
            out.append(entry)
        return out


class TextOffsets:
    """Each token's character offset in a text, as its tokens arrive: the UTF-8 decoder holds back
    a character until its last byte, so every token of a character has that character's offset."""

    def __init__(self):
        self.decoder, self.at = codecs.getincrementaldecoder("utf-8")("replace"), 0

    def next(self, token_bytes: bytes) -> int:
        at = self.at
        self.at += len(self.decoder.decode(token_bytes))
        return at


def token_drafts(out) -> list[dict]:
    """Per token of a StepOutput: the draft verified at its place (None: none was) and whether it is that
    draft, kept (speculative decoding; the page marks them)."""
    drafts = out.drafts or []
    return [{"draft": drafts[i] if i < len(drafts) else None, "accepted": i < len(drafts) and t == drafts[i]}
            for i, t in enumerate(out.token_ids)]


def token_logprobs(out) -> list[tuple]:
    """(token, log p, [(id, log p)]) for each token of a StepOutput that carries logprobs."""
    return [(t, lp, top) for t, (lp, top) in zip(out.token_ids, out.logprobs or [])]


def usage(requests, generated: bool = True) -> dict:
    """Token counts: each prompt once (its n choices share it), every generated token (an eos
    included), unless `generated` is False (completions' echo with max_tokens 0); of the prompt
    tokens, those the prefix cache served (OpenAI's prompt_tokens_details.cached_tokens)."""
    leaders = [r for r in requests if r.leader is None]
    prompt = sum(len(r.prompt_ids) for r in leaders)
    cached = sum(r.prompt_cached or 0 for r in leaders)
    completion = sum(len(r.output_ids) for r in requests) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}

