"""`npqwen serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    GET  /                          the web page: chat, and why each token was chosen (static/)
    GET  /v1/models                 the one model served
    POST /v1/chat/completions       chat, streamed or not: reasoning, tool calls, logprobs, n
    POST /v1/completions            plain completion of a prompt (text or token ids)
    POST /v1/npqwen/attention       one position's attention in every head of a layer (for the page)
    POST /v1/npqwen/experts         the experts one token went to in each layer (Qwen3-MoE; for the page)
    POST /tokenize, /detokenize     the model's tokenizer (vLLM's shapes)
    GET  /health                    200 while the engine thread is alive
    GET  /metrics                   Prometheus text format

A thin layer: a handler checks the body (protocol.py), turns it into engine Requests
(tokenizing and the chat template happen here; model code never does), hands them to the engine
thread (engine_loop.py), and writes what comes back in OpenAI's shapes. A client that goes away
has its requests aborted before the next engine step. The attention endpoint's forward pass also
runs on the engine thread, between two steps.
"""
import asyncio
import contextlib
import json
import secrets
import sys
import time
import traceback
import uuid
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from ..errors import NpqwenError
from ..generate import check_token_ids
from ..backend import to_numpy
from .engine_loop import EngineLoop, EngineStopped
from .parsers import StreamParser, finish_reason, parse_output
from .protocol import (MAX_ATTENTION_TOKENS, APIError, AttentionRequest, ChatCompletionRequest, CompletionRequest,
                       DetokenizeRequest, ExpertsRequest, NamedToolChoice, TokenizeRequest, template_messages)

DEFAULT_MAX_QUEUE = 256                    # waiting requests; one more is a 429
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # a bigger body is a 413
DISCONNECT_POLL_SECONDS = 0.05             # how often a waiting handler checks that its client is still there
STATIC = Path(__file__).parent / "static"   # the web page: plain files, no build step
PAGE_FILES = {"app.js": "text/javascript", "markdown.js": "text/javascript", "style.css": "text/css"}
OPEN_PATHS = ("/health", "/metrics", "/", *(f"/static/{name}" for name in PAGE_FILES))   # answered without the API key
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
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready=None) -> FastAPI:
    """The FastAPI app serving `engine` (over `llm`) as `model_name`; on_ready() runs once it is up."""
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

    app = FastAPI(title="npqwen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server, app.state.loop, app.state.metrics = server, loop, metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(APIKey, key=api_key)
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

    @app.post("/v1/npqwen/attention")
    async def attention(body: AttentionRequest, http: HTTPRequest):
        return await server.attention(body, http)

    @app.post("/v1/npqwen/experts")
    async def experts(body: ExpertsRequest, http: HTTPRequest):
        return await server.experts(body, http)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return server.detokenize(body)

    return app


class Choice:
    """One choice of an HTTP call: its engine request and what has been produced and sent of it."""

    def __init__(self, index: int, request, parser: StreamParser | None = None):
        self.index, self.request, self.parser = index, request, parser
        self.text = ""
        self.finish_reason = None
        self.logprobs = []        # (token, log p, top) not sent yet (a stream), or all of them
        self.token_ids = []       # ids sampled and not sent yet (a stream), or all of them


class Server:
    """What the handlers do, apart from FastAPI's wiring."""

    def __init__(self, llm, engine, loop: EngineLoop, model_name: str, max_queue: int):
        self.llm, self.engine, self.loop = llm, engine, loop
        self.tokenizer, self.config = llm.tokenizer, llm.config
        self.model_name, self.max_queue = model_name, max_queue
        self.created = int(time.time())

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "npqwen",
                "max_model_len": self.config.max_position_embeddings}

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

    def requests(self, prompt, body, max_tokens: int | None, logprobs: int | None, param: str) -> list:
        """The n engine requests of one prompt (choices after the first follow it, sharing its pages)."""
        try:
            ids = self.llm.prompt_ids(prompt)
        except NpqwenError as e:
            raise APIError(400, str(e), param) from None
        if not ids:
            raise APIError(400, f"{param} is empty", param)
        context = self.config.max_position_embeddings
        if max_tokens is not None and len(ids) + max_tokens > context:
            raise APIError(400, f"this model's context is {context} tokens, but the request has {len(ids)} "
                                f"prompt tokens and asks for {max_tokens} more ({len(ids) + max_tokens}); shorten "
                                f"the {param} or lower max_tokens", param, "context_length_exceeded")
        if max_tokens is None:   # as much as the context and the KV pool allow
            max_tokens = min(context, self.engine.pool.num_pages * self.engine.page_size) - len(ids)
            if max_tokens < 1:
                raise APIError(400, f"the {param} has {len(ids)} tokens, which leaves no room to generate in "
                                    f"this server's context or KV cache; shorten it", param,
                               "context_length_exceeded")
        made = []
        for i in range(body.n):
            seed = None if body.seed is None else (body.seed + i) % 2 ** 64   # each choice its own draw
            try:
                req = self.engine.new_request(ids, max_tokens, seed=seed, logprobs=logprobs, **body.sampling())
            except NpqwenError as e:
                field = str(e).split(" ", 1)[0]
                raise APIError(400, str(e), field if field in type(body).model_fields else "max_tokens") from None
            if made:
                req.leader = made[0]
            made.append(req)
        return made

    def submit(self, requests: list) -> asyncio.Queue:
        """Hand the requests to the engine thread (before any response starts, so that a full queue
        is a real 429); their outputs come through the queue returned."""
        if self.loop.queued() + len(requests) > self.max_queue:
            raise APIError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry later",
                           None, "queue_full", type="rate_limit_exceeded")
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
                c.finish_reason = out.finish_reason
        return not await http.is_disconnected() and all(c.finish_reason is not None for c in choices)

    # -- chat --

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        tools_on = bool(body.tools) and body.tool_choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if tools_on else None
        # tool_choice "required" or a named function: the answer is made to start with the call
        # (no grammar-constrained decoding here), so the model writes no reasoning first.
        prefix = ""
        if tools_on and body.tool_choice == "required":
            prefix = '<tool_call>\n{"name": "'
        elif tools_on and isinstance(body.tool_choice, NamedToolChoice):
            prefix = '<tool_call>\n{"name": ' + json.dumps(body.tool_choice.function.name) + ', "arguments": '
        thinking = body.thinking and not prefix
        try:
            prompt = self.llm.chat_prompt(template_messages(body.messages), enable_thinking=thinking, tools=tools)
        except NpqwenError as e:
            raise APIError(400, str(e), "messages") from None
        opened = thinking and prompt.rstrip("\n").endswith("<think>")   # a template that opens the reasoning
        prompt += prefix
        top = (body.top_logprobs or 0) if body.logprobs else None
        requests = self.requests(prompt, body, body.max_new_tokens, top, "messages")
        one_call = body.parallel_tool_calls is False
        choices = [Choice(i, r, StreamParser(thinking, tools=tools_on, opened=opened)) for i, r in enumerate(requests)]
        for c in choices:
            c.parser.feed(prefix)
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
            parsed = parse_output(prefix + c.text, thinking, tools=tools_on, opened=opened)
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
        return {**call, "object": "chat.completion", **prompt_ids, "choices": answers, "usage": usage(requests)}

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
        requests = []
        for prompt in body.prompts():
            requests += self.requests(prompt, body, body.max_tokens, body.logprobs, "prompt")
        choices = [Choice(i, r) for i, r in enumerate(requests)]
        call = dict(id="cmpl-" + uuid.uuid4().hex, created=int(time.time()), model=self.model_name)
        queue = self.submit(requests)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(self.completion_stream(queue, choices, call, include_usage, body.logprobs is not None,
                                              body.return_token_ids, http),
                       lambda: self.loop.abort(requests))
        if not await self.collect(queue, choices, http):
            return Response(status_code=499)
        answers = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": self.completion_logprobs(c.logprobs) if body.logprobs is not None else None,
                    **({"prompt_token_ids": c.request.prompt_ids, "token_ids": c.token_ids}
                       if body.return_token_ids else {})}
                   for c in choices]
        return {**call, "object": "text_completion", "choices": answers, "usage": usage(requests)}

    async def completion_stream(self, queue, choices, call, include_usage: bool, logprobs: bool, return_ids: bool,
                                http):
        prompt_sent = set()   # choices whose first chunk (with prompt_token_ids) is out
        async for index, out in self.outputs(queue, [c.request for c in choices], http):
            c = choices[index]
            c.logprobs += token_logprobs(out)
            c.token_ids += out.token_ids
            if out.text or out.finished:
                choice = {"index": index, "text": out.text, "finish_reason": out.finish_reason,
                          "logprobs": self.completion_logprobs(c.logprobs) if logprobs else None}
                if return_ids:
                    choice["token_ids"] = c.token_ids
                    if index not in prompt_sent:
                        choice["prompt_token_ids"] = c.request.prompt_ids
                        prompt_sent.add(index)
                yield {**call, "object": "text_completion", "choices": [choice],
                       **({"usage": None} if include_usage else {})}
                c.logprobs, c.token_ids = [], []
        if include_usage:
            yield {**call, "object": "text_completion", "choices": [],
                   "usage": usage([c.request for c in choices])}

    def completion_logprobs(self, entries) -> dict:
        """The legacy completions shape: parallel lists of tokens, their log p and {token: log p} alternatives."""
        decode = self.tokenizer.decode
        return {"tokens": [decode([t]) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{decode([t]): l for t, l in top} for _, _, top in entries],
                "text_offset": []}

    # -- attention (for the web page) --

    async def attention(self, body: AttentionRequest, http: HTTPRequest) -> dict:
        """The attention row of `position` over positions 0 .. position in every head of `layer`, and
        their mean: a forward pass with a recorder over tokens[:position + 1], run on the engine thread."""
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

        def keep(step, array):   # a recorder that keeps only the one array asked for
            if step == name:
                kept[step] = array

        def run():   # on the engine thread, between two steps
            self.llm.forward(ids[:p + 1], last_only=True, recorder=keep)
            return to_numpy(kept[name])[:, p, :].astype("float64")   # (H, p + 1, p + 1) -> (H, p + 1)

        future = self.loop.call(run)
        try:
            while not future.done():   # checked on a clock, like outputs(): the client may go, the engine stop
                await asyncio.wait([future], timeout=DISCONNECT_POLL_SECONDS)
                if future.done():
                    break
                if not self.loop.thread.is_alive():
                    raise EngineStopped("the server is shutting down")
                if await http.is_disconnected():
                    return Response(status_code=499)
        finally:
            future.cancel()   # nothing if it ran; skipped on the engine thread if it had not
        if future.exception() is not None:   # not the client's doing (the request was checked): say so
            traceback.print_exception(future.exception(), file=sys.stderr)
            raise APIError(500, f"the attention pass failed ({future.exception()!r}); see the server log",
                           type="server_error")
        rows = future.result()
        decode = self.tokenizer.decode
        return {"object": "npqwen.attention", "model": self.model_name, "layer": body.layer, "position": p,
                "num_layers": layers, "num_heads": heads, "tokens": [decode([t]) for t in ids[:p + 1]],
                "token_bytes": [list(self.tokenizer.token_bytes(t)) for t in ids[:p + 1]],   # as logprobs' "bytes"
                "heads": rows.tolist(), "mean": rows.mean(axis=0).tolist()}

    # -- experts (for the web page) --

    async def experts(self, body: ExpertsRequest, http: HTTPRequest) -> dict:
        """Qwen3-MoE: the experts the router sent token `position` to in each layer, best first, with their
        weights; a forward pass with a recorder over tokens[:position + 1], run on the engine thread. A dense
        model has none: num_experts 0 and no layers, answered without a pass."""
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

        def keep(step, array):   # a recorder that keeps position p's row of the router's choices
            if step.endswith((".mlp.gate.top_k_index", ".mlp.gate.top_k_weights")):
                kept[step] = to_numpy(array)[p].tolist()

        def run():   # on the engine thread, between two steps
            self.llm.forward(ids[:p + 1], last_only=True, recorder=keep)

        result = await self.on_engine_thread(run, http, "the experts pass")
        if isinstance(result, Response):
            return result
        for i in range(cfg.num_hidden_layers):
            gate = f"model.layers.{i}.mlp.gate"
            answer["layers"].append({"layer": i, "experts": kept.get(f"{gate}.top_k_index"),    # None: dense
                                     "weights": kept.get(f"{gate}.top_k_weights")})
        return answer

    async def on_engine_thread(self, run, http: HTTPRequest, what: str):
        """run() on the engine thread, between two steps; a 499 Response if the client leaves first."""
        future = self.loop.call(run)
        try:
            while not future.done():   # checked on a clock: the client may go, the engine stop
                await asyncio.wait([future], timeout=DISCONNECT_POLL_SECONDS)
                if future.done():
                    break
                if not self.loop.thread.is_alive():
                    raise EngineStopped("the server is shutting down")
                if await http.is_disconnected():
                    return Response(status_code=499)
        finally:
            future.cancel()   # nothing if it ran; skipped on the engine thread if it had not
        if future.exception() is not None:   # not the client's doing (the request was checked): say so
            traceback.print_exception(future.exception(), file=sys.stderr)
            raise APIError(500, f"{what} failed ({future.exception()!r}); see the server log", type="server_error")
        return future.result()

    # -- tokenizer --

    def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else True
            messages = template_messages(body.messages)
            try:
                text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, thinking)
            except NpqwenError as e:
                raise APIError(400, str(e), "messages") from None
        else:
            text = body.prompt
        try:
            ids = self.tokenizer.encode(text)
        except NpqwenError as e:
            raise APIError(400, str(e), "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.config.max_position_embeddings}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        self.check_tokens(body.tokens)
        return {"prompt": self.tokenizer.decode(body.tokens)}


def token_logprobs(out) -> list[tuple]:
    """(token, log p, [(id, log p)]) for each token of a StepOutput that carries logprobs."""
    return [(t, lp, top) for t, (lp, top) in zip(out.token_ids, out.logprobs or [])]


def usage(requests) -> dict:
    """Token counts: the prompt once (the choices share it), every generated token (an eos included)."""
    prompt, completion = len(requests[0].prompt_ids), sum(len(r.output_ids) for r in requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(events, abort) -> "EventStream":
    """Server-sent events as OpenAI streams them: `data: {json}` per chunk, then `data: [DONE]`;
    an error after the stream began is one data event with an "error" object, then [DONE]."""
    async def lines():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except EngineStopped as e:
            yield f"data: {json.dumps(APIError(503, str(e), type='server_error').body())}\n\n"
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


# -- errors in OpenAI's shape --

def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def add_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return error_response(validation_api_error(e.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        message = str(e.detail)
        if isinstance(e.__cause__, UnicodeDecodeError):   # FastAPI's "error parsing the body"
            message = f"the body is not valid JSON: it is not UTF-8 ({e.__cause__.reason} at byte {e.__cause__.start})"
        return error_response(APIError(e.status_code, message, None, code))

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):   # not the client's doing; uvicorn logs the traceback
        return error_response(APIError(500, f"internal error ({type(e).__name__}); see the server log",
                                       type="server_error"))

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request, e: EngineStopped):
        return error_response(APIError(503, str(e), type="server_error"))


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


class APIKey:
    """ASGI middleware: with --api-key, every path but /health, /metrics and the page's files needs
    "Authorization: Bearer KEY" (the page asks the user for the key and sends it itself)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                said = "the API key was refused" if given else "no API key was sent"
                e = APIError(401, f"{said}: send the server's --api-key as 'Authorization: Bearer KEY'", None,
                             "invalid_api_key")
                return await JSONResponse(e.body(), 401)(scope, receive, send)
        await self.app(scope, receive, send)
