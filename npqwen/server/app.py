"""`npqwen serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    GET  /                          the web page: chat, and why each token was chosen (static/)
    GET  /v1/models                 the one model served
    POST /v1/chat/completions       chat, streamed or not: reasoning, tool calls, logprobs, n
    POST /v1/completions            plain completion of a prompt (text or token ids); echo, prompt logprobs
    POST /v1/responses              OpenAI's Responses API (responses.py), over the same requests as a chat
    POST /v1/embeddings             OpenAI's embeddings: a vector per input (npqwen/embed.py)
    POST /v1/rerank                 a relevance score per document, best first (npqwen/rerank.py)
    POST /v1/npqwen/attention       one position's attention in every head of a layer (for the page)
    POST /v1/npqwen/experts         the experts one token went to in each layer (Qwen3-MoE; for the page)
    POST /tokenize, /detokenize     the model's tokenizer (vLLM's shapes); GET /tokenizer_info
    GET  /health                    200 while the engine thread is alive
    GET  /metrics                   Prometheus text format

A thin layer: a handler checks the body (protocol.py), turns it into engine Requests
(tokenizing and the chat template happen here; model code never does), hands them to the engine
thread (engine_loop.py), and writes what comes back in OpenAI's shapes. A client that goes away
has its requests aborted before the next engine step. The chat template and the tokenizer run in
worker threads (Server.off_loop), so that a prompt of megabytes never holds up the event loop;
the attention endpoint is an engine request like the others, read a chunk per step.
"""
import asyncio
import codecs
import contextlib
import functools
import json
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from ..errors import NpqwenError
from ..backend import to_numpy
from ..checks import check_token_ids
from ..model import check_lm_head
from ..structured import ConstraintError
from .constraints import chat_constraint, format_constraint
from .embeddings import embeddings, rerank
from .engine_loop import EngineLoop, EngineStopped
from .parsers import StreamParser, finish_reason, parse_output
from .tokenizer_process import LONG_TEXT_CHARS, TokenizerProcess
from .protocol import (IGNORED, MAX_ATTENTION_TOKENS, APIError, AttentionRequest, ChatCompletionRequest,
                       CompletionRequest, DetokenizeRequest, EmbeddingRequest, ExpertsRequest, RerankRequest,
                       TokenizeRequest, template_messages)

DEFAULT_MAX_QUEUE = 256                    # waiting requests; one more is a 429
RETRY_AFTER_SECONDS = 1                    # a 429's Retry-After
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # a bigger body is a 413
DISCONNECT_POLL_SECONDS = 0.05             # how often a waiting handler checks that its client is still there
PROMPT_WORKERS = 4                         # threads that apply the chat template and tokenize (see Server.off_loop)
STATIC = Path(__file__).parent / "static"   # the web page: plain files, no build step
PAGE_FILES = {"app.js": "text/javascript", "markdown.js": "text/javascript", "style.css": "text/css"}
OPEN_PATHS = ("/health", "/metrics", "/", "/openapi.json", "/docs",                       # answered without the API key
              *(f"/static/{name}" for name in PAGE_FILES))
# The page's own files are the only code it runs (no inline script, nothing from elsewhere): a second
# wall behind the rule that model text is never parsed as HTML.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' "
                                           "data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                                           "frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class Metrics:
    """Counters the engine thread updates, and the engine's state read at each scrape."""

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        self.prompt_tokens = Counter("npqwen_prompt_tokens", "Prompt tokens of the requests added", registry=registry)
        self.generation_tokens = Counter("npqwen_generation_tokens", "Tokens generated", registry=registry)
        self.finished = Counter("npqwen_requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=registry)
        self.embedding_inputs = Counter("npqwen_embedding_inputs", "Inputs embedded by /v1/embeddings",
                                        registry=registry)
        self.rerank_documents = Counter("npqwen_rerank_documents", "Documents scored by /v1/rerank",
                                        registry=registry)
        self.time_to_first_token = Histogram(
            "npqwen_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120), registry=registry)
        registry.register(EngineState(engine))


class EngineState:
    """A prometheus_client collector: the engine's stats at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        used = s["kv_pages_total"] - s["kv_pages_free"] - s["kv_pages_cached"]
        yield GaugeMetricFamily("npqwen_requests_running", "Requests in the running batch", value=s["running"])
        yield GaugeMetricFamily("npqwen_requests_waiting", "Requests waiting to be admitted", value=s["waiting"])
        yield GaugeMetricFamily("npqwen_kv_pages_used", "KV-cache pages held by requests", value=used)
        yield GaugeMetricFamily("npqwen_kv_pages_cached", "Free KV-cache pages still holding a cached prefix",
                                value=s["kv_pages_cached"])
        yield GaugeMetricFamily("npqwen_kv_pages_total", "KV-cache pages in the pool", value=s["kv_pages_total"])
        yield CounterMetricFamily("npqwen_prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache",
                                  value=s["prefix_cache_hit_tokens"])
        yield CounterMetricFamily("npqwen_preemptions", "Requests preempted for lack of pages",
                                  value=s["preemptions"])


def create_app(llm, engine, model_name: str, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready=None,
               allowed_origins: list[str] | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (over `llm`) as `model_name`; on_ready() runs once it is up.
    `allowed_origins`: web pages of these origins may call the API (CORS; "*" any); none by default."""
    metrics = Metrics(engine)
    loop = EngineLoop(engine, metrics)
    server = Server(llm, engine, loop, model_name, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        if on_ready is not None:
            on_ready()
        yield
        loop.stop()
        server.close()

    app = FastAPI(title="npqwen", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.server, app.state.loop, app.state.metrics = server, loop, metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(JSONBodies)
    if api_key:
        app.add_middleware(APIKey, key=api_key)
    if allowed_origins:   # outermost: a browser's preflight OPTIONS is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["Retry-After"])
    app.openapi = lambda: openapi_schema(app, api_key is not None, model_name)
    add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/static/{name}", include_in_schema=False)
    async def page_file(name: str):
        if name not in PAGE_FILES:
            raise APIError(404, f"no static file {name!r}", None, "not_found")
        return FileResponse(STATIC / name, media_type=PAGE_FILES[name], headers=PAGE_HEADERS)

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise APIError(503, "the engine thread has stopped", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        server.check_model(name)
        return server.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await server.chat(body, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await server.complete(body, http)

    from .responses import Responder, ResponsesRequest   # it builds on this module's pieces
    responder = Responder(server)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: HTTPRequest):
        return await responder.respond(body, http)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, http: HTTPRequest):
        return await embeddings(server, body, http)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(body: RerankRequest, http: HTTPRequest):
        return await rerank(server, body, http)

    @app.post("/v1/npqwen/attention")
    async def attention(body: AttentionRequest, http: HTTPRequest):
        return await server.attention(body, http)

    @app.post("/v1/npqwen/experts")
    async def experts(body: ExpertsRequest, http: HTTPRequest):
        return await server.experts(body, http)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await server.off_loop(server.tokenize, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await server.off_loop(server.detokenize, body)

    return app


class Choice:
    """One choice of an HTTP call: its engine request and what has been produced and sent of it."""

    def __init__(self, index: int, request, parser: StreamParser | None = None):
        self.index, self.request, self.parser = index, request, parser
        self.text = ""
        self.finish_reason = None
        self.logprobs = []        # (token, log p, top) not sent yet (a stream), or all of them
        self.token_ids = []       # ids sampled and not sent yet (a stream), or all of them
        self.prompt_logprobs = []  # (log p, top, rank) of each prompt token after the first, when scored
        self.offsets = TextOffsets()   # completions' text_offset, across the chunks of a stream
        self.echoed = False       # a streamed echo: the prompt's chunk is out


class Server:
    """What the handlers do, apart from FastAPI's wiring."""

    def __init__(self, llm, engine, loop: EngineLoop, model_name: str, max_queue: int):
        self.llm, self.engine, self.loop = llm, engine, loop
        self.tokenizer, self.config = llm.tokenizer, llm.config
        self.model_name, self.max_queue = model_name, max_queue
        self.created = int(time.time())
        self.workers = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="npqwen-prompt")
        self.ignored: set[str] = set()   # OpenAI's service fields seen so far (note_ignored)
        self.tokenizer_process = TokenizerProcess(self.tokenizer) if self.tokenizer is not None else None
        if self.tokenizer is not None:   # it reads the whole vocabulary once: now, not in a request's time
            self.tokenizer.fewest_tokens("")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The tokenizer's ids of a text; a long one is tokenized in the tokenizer process (see there why)."""
        if len(text) > LONG_TEXT_CHARS:
            return self.tokenizer_process.encode(text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def off_loop(self, fn, *args):
        """fn(*args) in a worker thread. Applying the chat template to a long conversation and
        tokenizing it take seconds for megabytes of text; on the event loop every other client's
        stream and /health would wait that long (the tokenizer lets go of the GIL while it works)."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(fn, *args))

    def close(self):
        self.workers.shutdown(wait=False, cancel_futures=True)
        if self.tokenizer_process is not None:
            self.tokenizer_process.close()

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "npqwen",
                "max_model_len": self.config.max_position_embeddings,
                "kind": self.llm.kind}   # "embedding", "reranker" or "generation": what it was made for

    def check_model(self, name: str | None):
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def check_tokens(self, ids: list[int]):
        """Token ids a client sent, by the rule every prompt follows (generate.check_token_ids)."""
        try:
            check_token_ids(ids, self.config.vocab_size)
        except NpqwenError as e:
            raise APIError(400, str(e), "tokens") from None

    # -- making engine requests --

    def check_room(self, tokens: int, max_tokens: int | None, param: str, at_least: str = "") -> int:
        """max_tokens, or when unset what the context and the KV pool leave; a 400 if the prompt's
        `tokens` (or, before tokenizing, a lower bound on them: `at_least` says so) leave no room."""
        context = self.config.max_position_embeddings
        if max_tokens is not None and tokens + max_tokens > context:
            raise APIError(400, f"this model's context is {context} tokens, but the request has {at_least}{tokens} "
                                f"prompt tokens and asks for {max_tokens} more ({tokens + max_tokens}); shorten "
                                f"the {param} or lower max_tokens", param, "context_length_exceeded")
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
                 thinking: bool = False) -> list:
        """The n engine requests of one prompt (choices after the first follow it, sharing its pages;
        the first scores the prompt when `prompt_logprobs` is set); `constraint`: (Engine.new_request's
        constraint arguments, the body field they came from)."""
        self.check_size(prompt, max_tokens, param)
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
        made = []
        constrain, constraint_param = constraint or ({}, None)
        for i in range(body.n):
            seed = None if body.seed is None else (body.seed + i) % 2 ** 64   # each choice its own draw
            try:
                req = self.engine.new_request(ids, max_tokens, seed=seed, logprobs=logprobs, **body.sampling(),
                                              prompt_logprobs=None if made else prompt_logprobs, **constrain,
                                              thinking=thinking)
            except ConstraintError as e:
                raise APIError(400, str(e), constraint_param) from None
            except NpqwenError as e:
                field = str(e).split(" ", 1)[0]
                raise APIError(400, str(e), field if field in type(body).model_fields else "max_tokens") from None
            self.vllm_options(req, body, max_tokens)
            if made:
                req.leader = made[0]
            made.append(req)
        return made

    def vllm_options(self, req, body, max_tokens: int):
        """vLLM's ignore_eos, min_tokens, skip_special_tokens and include_stop_str_in_output on an engine request."""
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens {body.min_tokens} is more than max_tokens {max_tokens}", "min_tokens")
        if body.ignore_eos:
            req.eos_ids = frozenset()
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

    def submit(self, requests: list) -> asyncio.Queue:
        """Hand the requests to the engine thread (before any response starts, so that a full queue
        is a real 429); their outputs come through the queue returned."""
        if len(requests) > self.max_queue:   # a 429 would never succeed: retrying clients would loop on it
            prompts = sum(r.leader is None for r in requests)
            many = (f"{prompts} prompts x n = {len(requests)} requests" if prompts < len(requests)
                    else f"{prompts} prompts")
            raise APIError(400, f"this call makes {many}, more than this server ever queues (--max-queue "
                                f"{self.max_queue}); send at most {self.max_queue} at a time",
                           "n" if prompts < len(requests) else "prompt", "too_many_requests")
        if self.loop.queued() + len(requests) > self.max_queue:
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
                c.prompt_logprobs += out.prompt_logprobs or []
                c.finish_reason = out.finish_reason
        return not await http.is_disconnected() and all(c.finish_reason is not None for c in choices)

    # -- chat --

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        self.note_ignored(body)
        tools_on, tools = self.chat_tools(body)
        thinking = body.thinking and not body.continue_final_message   # a continued message: all content
        top = (body.top_logprobs or 0) if body.logprobs else None
        opened, requests = await self.off_loop(self.chat_requests, body, thinking, tools, top)
        one_call = body.parallel_tool_calls is False
        choices = [Choice(i, r, StreamParser(thinking, tools=tools_on, opened=opened)) for i, r in enumerate(requests)]
        call = dict(id="chatcmpl-" + uuid.uuid4().hex, created=int(time.time()), model=self.model_name)
        queue = self.submit(requests)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            ids = body.return_token_ids
            return sse(self.chat_stream(queue, choices, call, include_usage, body.logprobs, one_call, ids, http),
                       lambda: self.loop.abort(requests))
        if not await self.collect(queue, choices, http):
            return Response(status_code=499)   # nobody is listening any more
        answers = []
        for c in choices:
            parsed = parse_output(c.text, thinking, tools=tools_on, opened=opened)
            tool_calls = parsed.tool_calls[:1] if one_call else parsed.tool_calls
            message = {"role": "assistant", "content": parsed.content if parsed.content or not tool_calls else None}
            if thinking:
                message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
            if tool_calls:
                message["tool_calls"] = tool_calls
            answers.append({"index": c.index, "message": message,
                            "logprobs": {"content": self.chat_logprobs(c.logprobs)} if body.logprobs else None,
                            "finish_reason": finish_reason(c.finish_reason, bool(tool_calls)),
                            **({"token_ids": c.token_ids} if body.return_token_ids else {})})
        prompt_ids = {"prompt_token_ids": requests[0].prompt_ids} if body.return_token_ids else {}
        if body.prompt_logprobs is not None:   # vLLM's, at the top: the choices share the prompt
            prompt_ids["prompt_logprobs"] = self.vllm_prompt_logprobs(choices[0])
        return {**call, "object": "chat.completion", **prompt_ids, "choices": answers, "usage": usage(requests)}

    def chat_tools(self, body: ChatCompletionRequest) -> tuple[bool, list | None]:
        """(whether tool calls are parsed, the tools for the template)."""
        tools_on = bool(body.tools) and body.tool_choice != "none"
        return tools_on, [t.model_dump(exclude_none=True) for t in body.tools] if tools_on else None

    def chat_requests(self, body: ChatCompletionRequest, thinking: bool, tools, top) -> tuple:
        """(whether the template opened the reasoning, the engine requests); runs off the event loop.
        response_format, structured_outputs, or tool_choice "required" / named / strict functions
        constrain the answer (after its reasoning, with thinking on): constraints.py."""
        constraint = chat_constraint(body, self.tokenizer, self.config.vocab_size, self.llm.eos_token_ids)
        texts = [m.content if isinstance(m.content, str) else "".join(getattr(p, "text", "") for p in m.content)
                 for m in body.messages if m.content]
        if sum(map(len, texts)) > LONG_TEXT_CHARS:   # the template only adds text: a bound before it runs
            fewest = sum(self.tokenizer.fewest_tokens(t) for t in texts)
            self.check_room(fewest, body.max_new_tokens, "messages", f"{sum(map(len, texts))} characters, so at least ")
        try:
            prompt = self.chat_text(body, template_messages(body.messages), thinking, tools)
        except NpqwenError as e:
            raise APIError(400, str(e), "messages") from None
        opened = thinking and prompt.rstrip("\n").endswith("<think>")   # a template that opens the reasoning
        return opened, self.requests(prompt, body, body.max_new_tokens, top, "messages", body.prompt_logprobs,
                                     constraint, thinking)

    def chat_text(self, body: ChatCompletionRequest, messages: list[dict], thinking: bool, tools) -> str:
        """The chat template's text; vLLM's add_generation_prompt false leaves out the assistant's
        opening, and continue_final_message cuts the text after the last message's words, as
        transformers does, so that the model goes on writing it."""
        text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, thinking, tools)
        if not body.continue_final_message:
            return text
        final = messages[-1]["content"]
        for words in (final, final.strip()):   # the template may have stripped the message
            at = text.rfind(words) if words else -1
            if at >= 0:
                return text[:at + len(words)]
        raise APIError(400, "continue_final_message: the last message has no text that the chat template kept, so "
                            "there is nothing to continue", "continue_final_message")

    async def chat_stream(self, queue, choices: list[Choice], call: dict, include_usage: bool, logprobs: bool,
                          one_call: bool, return_ids: bool, http: HTTPRequest):
        def chunk(c, delta, finish=None):
            """A chunk of choice c; it carries (and clears) the logprobs and ids c has not sent yet."""
            choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if logprobs:
                choice["logprobs"] = {"content": self.chat_logprobs(c.logprobs)}
            if return_ids:
                choice["token_ids"] = c.token_ids
            c.logprobs, c.token_ids = [], []
            return {**call, "object": "chat.completion.chunk", "choices": [choice],
                    **({"usage": None} if include_usage else {})}

        for c in choices:
            first = chunk(c, {"role": "assistant", "content": ""})
            if return_ids and c.index == 0:   # the choices share one prompt
                first = {**first, "prompt_token_ids": c.request.prompt_ids}
            yield first
        async for index, out in self.outputs(queue, [c.request for c in choices], http):
            c = choices[index]
            c.logprobs += token_logprobs(out)
            c.token_ids += out.token_ids
            deltas = c.parser.feed(out.text)
            if out.finished:
                deltas += c.parser.finish()
            for delta in deltas:
                if one_call and any(call_delta["index"] > 0 for call_delta in delta.get("tool_calls", [])):
                    continue
                if "reasoning_content" in delta:
                    delta["reasoning"] = delta["reasoning_content"]
                yield chunk(c, delta)
            if out.finished:
                yield chunk(c, {}, finish_reason(out.finish_reason, c.parser.n_calls > 0))
        if include_usage:
            yield {**call, "object": "chat.completion.chunk", "choices": [],
                   "usage": usage([c.request for c in choices])}

    def chat_logprobs(self, entries) -> list[dict]:
        def one(token, logprob):
            return {"token": self.tokenizer.decode([token]), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token))}
        return [{**one(token, lp), "top_logprobs": [one(t, l) for t, l in top]} for token, lp, top in entries]

    # -- completions --

    async def complete(self, body: CompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        self.note_ignored(body)
        requests = await self.off_loop(self.completion_requests, body)
        choices = [Choice(i, r) for i, r in enumerate(requests)]
        call = dict(id="cmpl-" + uuid.uuid4().hex, created=int(time.time()), model=self.model_name)
        queue = self.submit(requests)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(self.completion_stream(queue, choices, call, include_usage, body, http),
                       lambda: self.loop.abort(requests))
        if not await self.collect(queue, choices, http):
            return Response(status_code=499)
        leaders = {c.request: c for c in choices if c.request.leader is None}
        answers = []
        for c in choices:
            leader = leaders[c.request.leader or c.request]   # n choices share their prompt's scores
            if body.max_tokens == 0:   # echo alone: the one token the engine drew is not part of the answer
                c.text, c.logprobs, c.token_ids, c.finish_reason = "", [], [], "length"
            answer = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
            if body.echo:
                answer["text"] = self.tokenizer.decode(c.request.prompt_ids) + c.text
                c.logprobs = self.prompt_entries(leader) + c.logprobs
            if body.logprobs is not None:
                answer["logprobs"] = self.completion_logprobs(c.logprobs, c.offsets)
            if body.prompt_logprobs is not None:
                answer["prompt_logprobs"] = self.vllm_prompt_logprobs(leader)
            if body.return_token_ids:
                answer.update(prompt_token_ids=c.request.prompt_ids, token_ids=c.token_ids)
            answers.append(answer)
        return {**call, "object": "text_completion", "choices": answers,
                "usage": usage(requests, generated=body.max_tokens != 0)}

    def completion_requests(self, body: CompletionRequest) -> list:
        """Every prompt's n engine requests, in order; runs off the event loop. Echo with logprobs, and
        prompt_logprobs, make the first choice of each prompt score it; max_tokens 0 (echo alone)
        still draws one token, which the answer leaves out."""
        scored = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        max_tokens, scored = 1 if body.max_tokens == 0 else body.max_tokens, max(scored) if scored else None
        constraint = format_constraint(body)
        return [r for prompt in body.prompts() for r in self.requests(prompt, body, max_tokens, body.logprobs, "prompt",
                                                                     scored, constraint)]

    async def completion_stream(self, queue, choices, call, include_usage: bool, body: CompletionRequest, http):
        prompt_sent = set()   # choices whose first chunk (with prompt_token_ids) is out
        leaders = {c.request: c for c in choices if c.request.leader is None}

        def chunk(c, text: str, finish=None, prompt_logprobs=None):
            choice = {"index": c.index, "text": text, "finish_reason": finish,
                      "logprobs": self.completion_logprobs(c.logprobs, c.offsets) if body.logprobs is not None
                      else None}
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
                if c.index not in prompt_sent:
                    choice["prompt_token_ids"] = c.request.prompt_ids
                    prompt_sent.add(c.index)
            c.logprobs, c.token_ids = [], []
            return {**call, "object": "text_completion", "choices": [choice],
                    **({"usage": None} if include_usage else {})}

        async for index, out in self.outputs(queue, [c.request for c in choices], http):
            c = choices[index]
            c.prompt_logprobs += out.prompt_logprobs or []
            if not c.echoed and (out.token_ids or out.finished) and (body.echo or body.prompt_logprobs is not None):
                c.echoed = True   # the prompt has been read (and scored): it goes first
                leader = leaders[c.request.leader or c.request]
                c.logprobs = self.prompt_entries(leader) if body.echo else []
                yield chunk(c, self.tokenizer.decode(c.request.prompt_ids) if body.echo else "",
                            prompt_logprobs=self.vllm_prompt_logprobs(leader)
                            if body.prompt_logprobs is not None else None)
            if body.max_tokens == 0:   # echo alone: the token drawn is not part of the answer
                if out.finished:
                    yield chunk(c, "", "length")
                continue
            c.logprobs += token_logprobs(out)
            c.token_ids += out.token_ids
            if out.text or out.finished:
                yield chunk(c, out.text, out.finish_reason)
        if include_usage:
            yield {**call, "object": "text_completion", "choices": [],
                   "usage": usage([c.request for c in choices], generated=body.max_tokens != 0)}

    def prompt_entries(self, leader: Choice) -> list[tuple]:
        """The prompt's tokens as (token, log p, top) logprobs entries; the first has none (no context)."""
        ids = leader.request.prompt_ids
        return [(ids[0], None, None)] + [(t, lp, top) for t, (lp, top, _) in zip(ids[1:], leader.prompt_logprobs)]

    def vllm_prompt_logprobs(self, leader: Choice) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {id: {logprob, rank, decoded_token}}
        for the prompt's token and the most likely alternatives (their rank is their place)."""
        decode, ids = self.tokenizer.decode, leader.request.prompt_ids
        out = [None]
        for token, (lp, top, rank) in zip(ids[1:], leader.prompt_logprobs):
            entry = {str(t): {"logprob": l, "rank": i + 1, "decoded_token": decode([t])}
                     for i, (t, l) in enumerate(top)}
            entry[str(token)] = {"logprob": lp, "rank": rank, "decoded_token": decode([token])}
            out.append(entry)
        return out

    def completion_logprobs(self, entries, offsets: "TextOffsets") -> dict:
        """The legacy completions shape: parallel lists of tokens, their log p, {token: log p} of the
        most likely alternatives and the token drawn (OpenAI's up to logprobs + 1), and each token's
        character offset in the text. Keys are made distinct (token_key)."""
        tops = []
        for token, lp, top in entries:
            if lp is None:   # echo: the prompt's first token has no context
                tops.append(None)
                continue
            keys = {}
            for t, l in [*top, (token, lp)]:
                key = self.token_key(t)
                if keys.get(key, (t,))[0] != t:   # two tokens that read the same: the id tells them apart
                    key = f"token_id:{t}"
                keys.setdefault(key, (t, l))
            tops.append({key: l for key, (_, l) in keys.items()})
        return {"tokens": [self.token_key(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": tops,
                "text_offset": [offsets.next(self.tokenizer.token_bytes(t)) for t, _, _ in entries]}

    def token_key(self, token: int) -> str:
        """A token's text; one that is a piece of a UTF-8 character (and would print as U+FFFD) is
        written as its bytes, "bytes:\\xe2\\x80", as OpenAI writes such tokens."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    # -- attention (for the web page) --

    async def attention(self, body: AttentionRequest, http: HTTPRequest) -> dict:
        """The attention row of `position` over positions 0 .. position in every head of `layer`, and
        their mean: a probe over tokens[:position + 1] (see probe)."""
        self.check_model(body.model)
        ids, layers, heads = body.tokens, self.config.num_hidden_layers, self.config.num_attention_heads
        limit = min(MAX_ATTENTION_TOKENS, self.config.max_position_embeddings)
        if not 1 <= len(ids) <= limit:
            raise APIError(400, f"tokens has {len(ids)} ids; send 1 .. {limit} (the attention of a longer "
                                f"conversation is not served)", "tokens")
        self.check_tokens(ids)
        p = len(ids) - 1 if body.position is None else body.position
        if not 0 <= p < len(ids):
            raise APIError(400, f"position {p} is not a position of the {len(ids)} tokens (0 .. {len(ids) - 1})",
                           "position")
        if not 0 <= body.layer < layers:
            raise APIError(400, f"layer {body.layer} does not exist: the model has layers 0 .. {layers - 1}", "layer")
        name, kept = f"model.layers.{body.layer}.self_attn.attn_probs", {}

        def keep(step, array):   # the probe's last token: (H, 1, p + 1) -> (H, p + 1)
            if step == name:
                kept["rows"] = to_numpy(array)[:, 0]

        if not await self.probe(ids[:p + 1], keep, http):
            return Response(status_code=499)
        rows = kept["rows"]
        rows = rows.astype("float64")                                                  # (H, p + 1)
        decode = self.tokenizer.decode
        return {"object": "npqwen.attention", "model": self.model_name, "layer": body.layer, "position": p,
                "num_layers": layers, "num_heads": heads, "tokens": [decode([t]) for t in ids[:p + 1]],
                "token_bytes": [list(self.tokenizer.token_bytes(t)) for t in ids[:p + 1]],   # as logprobs' "bytes"
                "heads": rows.tolist(), "mean": rows.mean(axis=0).tolist()}

    async def probe(self, ids: list[int], recorder, http: HTTPRequest) -> bool:
        """An engine request that reads `ids` a chunk per step, like any prompt, and whose last token
        then runs alone with `recorder` (Engine._probe_pass); False if the client went away first."""
        try:
            req = self.engine.new_request(ids, 1, temperature=0)
        except NpqwenError as e:
            raise APIError(400, str(e), "tokens") from None
        req.probe = recorder
        async with contextlib.aclosing(self.outputs(self.submit([req]), [req], http)) as outputs:
            async for _, out in outputs:
                if out.finished:
                    return True
        return False

    # -- experts (for the web page) --

    async def experts(self, body: ExpertsRequest, http: HTTPRequest) -> dict:
        """Qwen3-MoE: the experts the router sent token `position` to in each layer, best first, with their
        weights; a probe over tokens[:position + 1] (see probe). A dense model has none: num_experts 0 and
        no layers, answered without a pass."""
        self.check_model(body.model)
        ids, cfg = body.tokens, self.config
        limit = min(MAX_ATTENTION_TOKENS, cfg.max_position_embeddings)
        if not 1 <= len(ids) <= limit:
            raise APIError(400, f"tokens has {len(ids)} ids; send 1 .. {limit}", "tokens")
        self.check_tokens(ids)
        p = len(ids) - 1 if body.position is None else body.position
        if not 0 <= p < len(ids):
            raise APIError(400, f"position {p} is not a position of the {len(ids)} tokens (0 .. {len(ids) - 1})",
                           "position")
        answer = {"object": "npqwen.experts", "model": self.model_name, "position": p,
                  "token": self.tokenizer.decode([ids[p]]), "num_experts": cfg.num_experts,
                  "num_experts_per_tok": cfg.num_experts_per_tok, "layers": []}
        if not cfg.num_experts:
            return answer
        kept = {}

        def keep(step, array):   # position p is the probe's last token: the one row of the router's choices
            if step.endswith((".mlp.gate.top_k_index", ".mlp.gate.top_k_weights")):
                kept[step] = to_numpy(array)[0].tolist()

        if not await self.probe(ids[:p + 1], keep, http):
            return Response(status_code=499)
        for i in range(cfg.num_hidden_layers):
            gate = f"model.layers.{i}.mlp.gate"
            answer["layers"].append({"layer": i, "experts": kept.get(f"{gate}.top_k_index"),    # None: dense
                                     "weights": kept.get(f"{gate}.top_k_weights")})
        return answer

    # -- tokenizer --

    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            thinking = body.chat_template_kwargs is None or body.chat_template_kwargs.enable_thinking is not False
            messages = template_messages(body.messages)
            try:
                text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, thinking)
            except NpqwenError as e:
                raise APIError(400, str(e), "messages") from None
        else:
            text = body.prompt
        param, context = "messages" if body.messages is not None else "prompt", self.config.max_position_embeddings
        fewest = self.tokenizer.fewest_tokens(text) if len(text) > LONG_TEXT_CHARS else 0
        # as vLLM: add_special_tokens defaults to true for a prompt, false for messages (the template has them)
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        try:
            ids = self.encode(text, special) if fewest <= context else None
        except NpqwenError as e:
            raise APIError(400, str(e), "prompt") from None
        if ids is None or len(ids) > context:   # as vLLM: what could never be a prompt is not counted
            count = f"{len(text)} characters, so at least {fewest}" if ids is None else len(ids)
            raise APIError(400, f"the {param} has {count} tokens, more than this model's context of {context}",
                           param, "context_length_exceeded")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.config.max_position_embeddings}

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info, as vLLM answers it: the tokenizer's configuration, its special tokens
        and chat template (lm-evaluation-harness's remote tokenizer reads it)."""
        return {"tokenizer_class": "npqwen.Tokenizer", **self.tokenizer.special_tokens,
                "chat_template": self.tokenizer.chat_template, "model_max_length": self.config.max_position_embeddings,
                "vocab_size": self.tokenizer.vocab_size}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        self.check_tokens(body.tokens)
        return {"prompt": self.tokenizer.decode(body.tokens)}


class TextOffsets:
    """Each token's character offset in a text, as its tokens arrive: the UTF-8 decoder holds back
    a character until its last byte, so every token of a character has that character's offset."""

    def __init__(self):
        self.decoder, self.at = codecs.getincrementaldecoder("utf-8")("replace"), 0

    def next(self, token_bytes: bytes) -> int:
        at = self.at
        self.at += len(self.decoder.decode(token_bytes))
        return at


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


def sse(events, abort) -> "EventStream":
    """Server-sent events as OpenAI streams them: `data: {json}` per chunk, then `data: [DONE]`;
    an error after the stream began is one data event with an "error" object, then [DONE]."""
    async def lines():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except EngineStopped as e:
            yield f"data: {json.dumps(APIError(e.status, str(e), type='server_error').body())}\n\n"
        yield "data: [DONE]\n\n"
    return EventStream(lines(), abort)


class EventStream(StreamingResponse):
    """A streamed response that aborts its requests when it ends, however it ends: a client gone
    before the first byte never starts the generator, so its own cleanup would never run."""

    def __init__(self, lines, abort):
        super().__init__(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.abort = abort

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.abort()   # requests that finished are already gone: nothing happens to them


# -- the schema: /openapi.json (and /docs) --

STREAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")   # 200: JSON, or text/event-stream
ENGINE_PATHS = (*STREAMED, "/v1/npqwen/attention")                      # 429 when the queue is full, 503 stopping
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk as JSON, or [DONE] at the end of a chat or completion"},
    "event": {"type": "string", "description": "a Responses event's type; otherwise 'message'"}}}
ERRORS = {400: "a request the server cannot serve, in OpenAI's error shape; param names the field",
          401: "a missing or wrong API key", 404: "another model's name", 413: "a body over the size limit",
          429: "the queue is full: retry after Retry-After seconds", 503: "the server is shutting down",
          500: "this request's constraint failed while it ran (llguidance); the other requests go on"}


def openapi_schema(app: FastAPI, with_key: bool, model_name: str) -> dict:
    """FastAPI's schema of the API, made to say what the server really answers: every error is a
    400 (never FastAPI's 422) or another status of ERRORS, in OpenAI's error shape; the streamed
    endpoints answer text/event-stream too; /metrics is Prometheus text; `model` is the one served."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    from .. import __version__
    schema = get_openapi(title="npqwen", version=__version__, routes=app.routes,
                         description="OpenAI's API (and vLLM's extras) over a Qwen3 in plain NumPy")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["Error"] = ERROR
    for component in components.values():
        if "model" in component.get("properties", {}):
            model = component["properties"]["model"]
            if model.get("type") == "string":
                model["enum"] = [model_name]
            else:   # optional: a string or null
                model["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):   # GET /v1/models/{name}
                if parameter["name"] == "name":
                    parameter["schema"]["examples"] = [model_name]
            codes = [400, 413] if method == "post" else []
            codes += [401] if with_key and path not in OPEN_PATHS else []
            codes += [404] if method == "post" or path.startswith("/v1/models/") else []
            codes += [429, 503] if path in ENGINE_PATHS else [503] if path == "/health" else []
            codes += [500] if path in STREAMED else []
            responses = operation["responses"]
            responses.pop("422", None)
            for code in sorted(codes):
                responses[str(code)] = {"description": ERRORS[code], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            if path in STREAMED:   # each server-sent event: its data a JSON chunk (or [DONE]), its event name
                responses["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    app.openapi_schema = schema
    return schema


# -- errors in OpenAI's shape --

def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def add_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        error = validation_api_error(e.errors())
        sent_as = request.scope.get("npqwen.content_type")
        if sent_as is not None and error.message.startswith("the body is not valid JSON"):
            error.message += f" (it was sent as Content-Type: {sent_as}; the API takes application/json)"
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        message = str(e.detail)
        if isinstance(e.__cause__, UnicodeDecodeError):   # FastAPI's "error parsing the body"
            message = f"the body is not valid JSON: it is not UTF-8 ({e.__cause__.reason} at byte {e.__cause__.start})"
        if e.status_code == 404 and request.url.path.startswith("/v1/responses/"):
            message = "npqwen keeps no responses (each is answered and forgotten): there is nothing to fetch here"
        elif e.status_code == 404:
            message = f"no endpoint {request.url.path}: see GET /openapi.json for the endpoints this server has"
        elif e.status_code == 405:
            message = f"{request.url.path} does not take {request.method}; it takes {e.headers.get('Allow', '?')}"
        return error_response(APIError(e.status_code, message, None, code, headers=e.headers))

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):   # not the client's doing; uvicorn logs the traceback
        return error_response(APIError(500, f"internal error ({type(e).__name__}); see the server log",
                                       type="server_error"))

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request, e: EngineStopped):
        return error_response(APIError(e.status, str(e), type="server_error"))


def validation_api_error(errors: list[dict]) -> APIError:
    """pydantic's first complaint as a 400 whose param names the field ("messages[0].role")."""
    def param(error):
        # pydantic puts the union member it tried in the path ("str", "list[int]", "function-after"): drop it
        loc = [p for p in error.get("loc", ()) if p != "body" and (isinstance(p, int) or p.isidentifier())
               and p not in ("str", "int", "float", "bool", "dict", "list", "none")]
        return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc)) or None

    e, name = errors[0], param(errors[0])
    if e["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    if e["type"] == "extra_forbidden":
        return APIError(400, f"unsupported field {name!r}: npqwen does not implement it; remove it", name,
                        "unsupported")
    if e["type"] == "missing":
        return APIError(400, f"{name!r} is required" if name else "the body is empty: send a JSON object", name)
    if name is None:
        return APIError(400, "the body must be a JSON object" if e["type"] == "model_attributes_type" else e["msg"])
    if sum(param(other) == name for other in errors) > 1:     # every member of a union refused it
        return APIError(400, f"{name}: not a value of an accepted type (as the OpenAI API defines the field)", name)
    return APIError(400, f"{name}: {e['msg']}", name)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413, by its Content-Length or as it arrives."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await JSONResponse(self.too_large().body(), 413)(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self.too_large().message)
            return message

        await self.app(scope, counting_receive, send)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is over {self.limit} bytes", None, "request_too_large")


class JSONBodies:
    """ASGI middleware: every body the API takes is JSON, so one sent without Content-Type:
    application/json (none at all, or curl -d's application/x-www-form-urlencoded) is read as JSON
    anyway, as vLLM reads it; if it is not JSON, the error says what it was sent as."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json" and not kind.endswith(b"+json"):
                scope = {**scope, "npqwen.content_type": kind.decode("latin-1") or "(none)",
                         "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class APIKey:
    """ASGI middleware: with --api-key, every path but /health, /metrics and the page's files needs
    "Authorization: Bearer KEY" (the page asks the user for the key and sends it itself)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.strip().partition(b" ")
            # the scheme's name is case-insensitive (RFC 7235): "bearer KEY" is as good as "Bearer KEY"
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.expected):
                said = "the API key was refused" if header else "no API key was sent"
                e = APIError(401, f"{said}: send the server's --api-key as 'Authorization: Bearer KEY'", None,
                             "invalid_api_key")
                return await JSONResponse(e.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)
