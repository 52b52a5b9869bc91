"""`npqwen serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    GET  /                          the web page: chat, and why each token was chosen (static/)
    GET  /v1/models                 the model served, and its LoRA adapters (their `model` selects them)
    POST /v1/chat/completions       chat, streamed or not: reasoning, tool calls, logprobs, n (serving_chat.py)
    POST /v1/completions            plain completion of a prompt (text or token ids); echo, prompt logprobs
    POST /v1/responses              OpenAI's Responses API (serving_responses.py), run as a chat
    POST /v1/messages               Anthropic's Messages API (serving_messages.py), run as a chat; and
                                    /v1/messages/count_tokens
    POST /v1/embeddings             OpenAI's embeddings: a vector per input (serving_pooling.py, npqwen/embed.py)
    POST /v1/rerank                 a relevance score per document, best first (npqwen/rerank.py)
    POST /v1/npqwen/attention       one position's attention in every head of a layer (serving_probes.py)
    POST /v1/npqwen/experts         the experts one token went to in each layer (Qwen3-MoE; for the page)
    POST /v1/npqwen/layers          one token's probability and rank under each layer's logit lens (the page)
    POST /v1/npqwen/saliency        gradient x input of one token's log-probability per token before it (the page)
    POST /v1/npqwen/features        an SAE's features on each token (--sae; the page's features view)
    POST /tokenize, /detokenize     the model's tokenizer (vLLM's shapes); GET /tokenizer_info
    GET  /health                    200 while the engine thread is alive
    (HEAD on every GET route: as GET, without the body)
    GET  /version                   npqwen's version (vLLM's route)
    POST /v1/load_lora_adapter      load / unload a LoRA adapter (vLLM's shapes; --allow-runtime-lora only)
    POST /v1/unload_lora_adapter
    GET  /metrics                   Prometheus text format (metrics.py)

How a request flows, the way vLLM's OpenAI server splits it: the route (one line here) calls its
API's handler, a method of a serving_*.py subclass of serving.Serving. The handler checks the body
(protocol.py) and turns it into engine Requests: the chat template and the tokenizer run here, in
worker threads (Serving.off_loop), never model code. Serving.submit hands them to the one thread
that owns the engine (engine_loop.py), which steps it and sends each output back through the
call's queue; the handler writes them in OpenAI's shapes, whole or as server-sent events (http.py).
JSON shapes and templates stay in the HTTP layer: the engine sees token ids and sampling values.
A client that goes away has its requests aborted before the next engine step.
"""
import contextlib

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import NpqwenError
from ..rerank import no_yes_ids
from .engine_loop import EngineLoop
from .http import (DEFAULT_MAX_BODY_BYTES, APIKey, BigBodies, BodyLimit, HeadAsGet, JSONBodies, add_error_handlers,
                   openapi_schema, page, page_file)
from .metrics import Metrics
from .protocol import (AttentionRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       EmbeddingRequest, ExpertsRequest, FeaturesRequest, LoraAdapterRequest, RerankRequest,
                       TokenizeRequest)
from .protocol_messages import CountTokensRequest, MessagesRequest
from .protocol_responses import ResponsesRequest
from .serving import PromptWorkers, Serving
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_lora import ServingLora
from .serving_messages import ServingMessages
from .serving_pooling import ServingPooling
from .serving_probes import ServingProbes
from .serving_responses import ServingResponses
from .serving_tokenization import ServingTokenization

DEFAULT_MAX_QUEUE = 256                    # waiting requests; one more is a 429


def can_rerank(llm) -> bool:
    """The model has the reranker's "no" and "yes" tokens (rerank.no_yes_ids)."""
    try:
        no_yes_ids(llm)
        return True
    except NpqwenError:
        return False


def create_app(llm, engine, model_name: str, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready=None,
               allowed_origins: list[str] | None = None, template_kwargs: dict | None = None,
               thinking_budget: int | None = None, allow_generation: bool = False,
               allow_runtime_lora: bool = False, saes: dict | None = None, labels: dict | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (over `llm`) as `model_name`; on_ready() runs once it is up.
    `allowed_origins`: web pages of these origins may call the API (CORS; "*" any); none by default.
    `template_kwargs`: the chat template's variables when a request does not set them (enable_thinking);
    `thinking_budget`: the reasoning tokens of a request that sets no budget (engine/thinking.py);
    `allow_generation`: chat and completions on an embedding model are served, not refused;
    `allow_runtime_lora`: clients may load LoRA adapters from the server's disk (serving_lora.py);
    `saes`: name -> SAE, for requests' feature_edits and the page's features view; `labels`: name -> {feature:
    description} (features.load_labels)."""
    metrics = Metrics(engine)
    loop = EngineLoop(engine, metrics)
    workers = PromptWorkers(llm.tokenizer)
    # one object per API, all over the same engine thread and prompt workers
    shared = dict(llm=llm, loop=loop, model_name=model_name, max_queue=max_queue, workers=workers,
                  template_kwargs=template_kwargs, thinking_budget=thinking_budget, allow_generation=allow_generation,
                  saes=saes, labels=labels)
    server, chat, completion = Serving(**shared), ServingChat(**shared), ServingCompletion(**shared)
    responder, pooling = ServingResponses(**shared), ServingPooling(**shared)
    probes, tokenization = ServingProbes(**shared), ServingTokenization(**shared)
    messages = ServingMessages(**shared)
    loras = ServingLora(allow_runtime_lora, **shared)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        if on_ready is not None:
            on_ready()
        yield
        loop.stop()
        workers.close()

    app = FastAPI(title="npqwen", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.loop, app.state.metrics = loop, metrics
    app.state.server, app.state.chat, app.state.completion, app.state.responses = server, chat, completion, responder
    app.state.pooling, app.state.probes, app.state.tokenization = pooling, probes, tokenization
    app.state.messages = messages
    app.add_middleware(HeadAsGet)   # innermost: the routes see a GET, the key check sees the request as sent
    if workers.tokenizer_process is not None:   # inside BodyLimit: a body over the limit is a 413 first
        app.add_middleware(BigBodies, process=workers.tokenizer_process, context=llm.config.max_position_embeddings)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(JSONBodies)
    if api_key:
        app.add_middleware(APIKey, key=api_key)
    if allowed_origins:   # outermost: a browser's preflight OPTIONS is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["Retry-After"])
    empty_input = llm.tokenizer is not None and bool(llm.tokenizer.encode("", add_special_tokens=True))
    app.openapi = lambda: openapi_schema(app, api_key is not None, model_name, llm.config, empty_input,
                                         can_rerank(llm))
    add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def page_index():
        return page()

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str):
        return page_file(name)

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/version")
    async def version():
        return server.version()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        return server.model(name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await chat.chat(body, http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await completion.complete(body, http)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: HTTPRequest):
        return await responder.respond(body, http)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, http: HTTPRequest):
        return await messages.create(body, http)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest):
        return await messages.count_tokens(body)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, http: HTTPRequest):
        return await pooling.embeddings(body, http)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(body: RerankRequest, http: HTTPRequest):
        return await pooling.rerank(body, http)

    @app.post("/v1/npqwen/attention")
    async def attention(body: AttentionRequest, http: HTTPRequest):
        return await probes.attention(body, http)

    @app.post("/v1/npqwen/experts")
    async def experts(body: ExpertsRequest, http: HTTPRequest):
        return await probes.experts(body, http)

    @app.post("/v1/npqwen/layers")
    async def layers(body: ExpertsRequest, http: HTTPRequest):   # the same fields: tokens, position
        return await probes.layers(body, http)

    @app.post("/v1/npqwen/saliency")
    async def saliency(body: ExpertsRequest, http: HTTPRequest):   # the same fields: tokens, position
        return await probes.saliency(body, http)
    @app.post("/v1/npqwen/features")
    async def features(body: FeaturesRequest, http: HTTPRequest):
        return await probes.features(body, http)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await tokenization.off_loop(tokenization.tokenize, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenization.tokenizer_info()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await tokenization.off_loop(tokenization.detokenize, body)

    @app.post("/v1/load_lora_adapter", include_in_schema=allow_runtime_lora)
    async def load_lora_adapter(body: LoraAdapterRequest):
        return await loras.load(body)

    @app.post("/v1/unload_lora_adapter", include_in_schema=allow_runtime_lora)
    async def unload_lora_adapter(body: LoraAdapterRequest):
        return loras.unload(body)

    return app
