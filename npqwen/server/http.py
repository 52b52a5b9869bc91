"""The HTTP layer under the handlers: the web page's files, server-sent events, OpenAI's error
shape for every error (FastAPI's own included; Anthropic's on /v1/messages), the /openapi.json
schema, and ASGI middlewares (HEAD as GET, a body-size limit, a big body checked in the tokenizer process,
JSON bodies whatever their Content-Type, the API key).
"""
import functools
import json
import secrets
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from .engine_loop import EngineStopped
from .openapi import tell_the_truth
from .protocol import APIError
from .protocol_messages import ANTHROPIC_ERROR, anthropic_error

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # a bigger body is a 413
BIG_BODY_BYTES = 256 * 1024                # a bigger body is first read in the tokenizer process (BigBodies)
STATIC = Path(__file__).parent / "static"   # the web page: plain files, no build step
PAGE_FILES = {"app.js": "text/javascript", "markdown.js": "text/javascript", "style.css": "text/css"}
OPEN_PATHS = ("/health", "/version", "/metrics", "/", "/openapi.json", "/docs",   # answered without the API key
              *(f"/static/{name}" for name in PAGE_FILES))
# The page's own files are the only code it runs (no inline script, nothing from elsewhere): a second
# wall behind the rule that model text is never parsed as HTML.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' "
                                           "data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                                           "frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def page() -> FileResponse:
    """GET /: the web page."""
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


def page_file(name: str) -> FileResponse:
    """GET /static/{name}: the page's own scripts and styles, and nothing else."""
    if name not in PAGE_FILES:
        raise APIError(404, f"no static file {name!r}", None, "not_found")
    return FileResponse(STATIC / name, media_type=PAGE_FILES[name], headers=PAGE_HEADERS)


# -- server-sent events --

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

MESSAGES_PATH = "/v1/messages"                                          # its errors in Anthropic's shape
STREAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", MESSAGES_PATH)   # 200: JSON or events
ENGINE_PATHS = (*STREAMED, "/v1/npqwen/attention")                      # 429 when the queue is full, 503 stopping
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk as JSON, or [DONE] at the end of a chat or completion"},
    "event": {"type": "string", "description": "a Responses or Messages event's type; otherwise 'message'"}}}
ERRORS = {400: "a request the server cannot serve, in OpenAI's error shape; param names the field",
          401: "a missing or wrong API key", 404: "another model's name", 413: "a body over the size limit",
          429: "the queue is full: retry after Retry-After seconds", 503: "the server is shutting down",
          500: "this request's constraint failed while it ran (llguidance); the other requests go on",
          529: "the server is shutting down (Anthropic's overloaded_error)"}


def openapi_schema(app: FastAPI, with_key: bool, model_name: str, config=None, empty_input: bool = False,
                   rerank: bool = True) -> dict:
    """FastAPI's schema of the API, made to say what the server really answers: every error is a
    400 (never FastAPI's 422) or another status of ERRORS, in OpenAI's error shape; the streamed
    endpoints answer text/event-stream too; /metrics is Prometheus text; `model` is the one served;
    bounds in JSON Schema's words (minimum, not pydantic's ge); token ids within the vocabulary."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    from .. import __version__
    schema = get_openapi(title="npqwen", version=__version__, routes=app.routes,
                         description="OpenAI's API (and vLLM's extras) over a Qwen3 in plain NumPy")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components["Error"], components["AnthropicError"] = ERROR, ANTHROPIC_ERROR
    tell_the_truth(schema, config, empty_input, rerank)   # openapi.py: the limits the handlers check
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
            anthropic = path.startswith(MESSAGES_PATH)   # Anthropic's shape, and 529 where OpenAI's is 503
            codes = [529 if anthropic and code == 503 else code for code in codes]
            responses = operation["responses"]
            responses.pop("422", None)
            for code in sorted(codes):
                responses[str(code)] = {"description": ERRORS[code], "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/" + ("AnthropicError" if anthropic else "Error")}}}}
            if path in STREAMED:   # each server-sent event: its data a JSON chunk (or [DONE]), its event name
                responses["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    app.openapi_schema = schema
    return schema


# -- errors in OpenAI's shape --

def error_response(e: APIError, path: str = "") -> JSONResponse:
    """The error in OpenAI's shape, or in Anthropic's on the Messages API's paths."""
    if path.startswith(MESSAGES_PATH):
        status, body = anthropic_error(e)
        return JSONResponse(body, status_code=status, headers=e.headers)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def add_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        error = validation_api_error(e.errors(), e.body)
        sent_as = request.scope.get("npqwen.content_type")
        if sent_as is not None and error.message.startswith("the body is not valid JSON"):
            error.message += f" (it was sent as Content-Type: {sent_as}; the API takes application/json)"
        return error_response(error, request.url.path)

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
        return error_response(APIError(e.status_code, message, None, code, headers=e.headers), request.url.path)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):   # not the client's doing; uvicorn logs the traceback
        return error_response(APIError(500, f"internal error ({type(e).__name__}); see the server log",
                                       type="server_error"), request.url.path)

    @app.exception_handler(EngineStopped)
    async def engine_stopped(request, e: EngineStopped):
        return error_response(APIError(e.status, str(e), type="server_error"), request.url.path)


def validation_api_error(errors: list[dict], body=None) -> APIError:
    """pydantic's first complaint as a 400 whose param names the field by its path in the body
    ("messages[0].role", "tools[0].eager_input_streaming")."""
    def param(error):
        loc = [p for p in error.get("loc", ()) if p != "body"]
        path = body_path(body, loc, error) if body is not None else None
        if path is None:   # no body to walk: drop the union members pydantic names ("str", "CustomTool")
            path = [p for p in loc if isinstance(p, int) or (p.isidentifier() and p not in model_names()
                    and p not in ("str", "int", "float", "bool", "dict", "list", "none"))]
        return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path)) or None

    # of the members of a union, the one that got deepest into the value says what is wrong ("unsupported
    # field messages[0].content[0].bogus"), not one whose type it does not have ("a valid string")
    names = [param(e) for e in errors]
    depth = [len(n.replace("[", ".[").split(".")) if n else 0 for n in names]
    e, name = errors[depth.index(max(depth))], names[depth.index(max(depth))]
    if e["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    if e["type"] == "extra_forbidden":
        return APIError(400, f"unsupported field {name!r}: npqwen does not implement it; remove it", name,
                        "unsupported")
    if e["type"] == "missing":
        return APIError(400, f"{name!r} is required" if name else "the body is empty: send a JSON object", name)
    if name is None:
        return APIError(400, "the body must be a JSON object" if e["type"] == "model_attributes_type" else e["msg"])
    if names.count(name) > 1:     # every member of a union refused it
        return APIError(400, f"{name}: not a value of an accepted type (as the OpenAI API defines the field)", name)
    return APIError(400, f"{name}: {e['msg']}", name)


def body_path(body, loc: list, error: dict) -> list | None:
    """The keys and indexes of `loc` that lead through the body to the value the error is about: the
    others are the union members and tags pydantic adds to the path ("list[...]", "CustomTool", a
    block's "text" tag). A missing field's name is kept last. None when no such path exists."""
    missing = error["type"] == "missing"
    parts, target = (loc[:-1], error.get("input")) if missing else (loc, error.get("input"))

    def walk(value, i: int):
        if i == len(parts):
            return [] if value is target or (type(value) is type(target) and value == target) else None
        p = parts[i]
        inside = (isinstance(value, dict) and isinstance(p, str) and p in value) or \
            (isinstance(value, list) and isinstance(p, int) and 0 <= p < len(value))
        if inside:
            rest = walk(value[p], i + 1)
            if rest is not None:
                return [p] + rest
        return walk(value, i + 1)   # a member's or tag's name, not a step into the body

    path = walk(body, 0)
    return path + loc[-1:] if path is not None and missing and loc else path


@functools.cache
def model_names() -> frozenset:
    """The names of the request shapes (pydantic models), which pydantic writes into an error's path."""
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)
    return frozenset(cls.__name__ for cls in subclasses(BaseModel))


class HeadAsGet:
    """ASGI middleware: HEAD is answered as GET would be, without the body (an uptime check sends
    HEAD /; RFC 9110 asks every GET route to take it). The headers, Content-Length included, are GET's."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)
        await self.app({**scope, "method": "GET"}, receive, headers_only)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is a 413, by its Content-Length or as it arrives."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await error_response(self.too_large(), scope["path"])(scope, receive, send)
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


class BigBodies:
    """ASGI middleware: a body over BIG_BODY_BYTES (by its Content-Length) is parsed first in the
    tokenizer process, not here: json.loads of 10 MB holds the GIL and the event loop for ~40 ms
    (400 ms on a busy machine), and every /health and stream waits that long. A string in it that
    cannot fit the context (tokenizer_process.check_body) is refused there and then; a body that
    might fit goes on to the routes, which parse it again."""

    def __init__(self, app, process, context: int):
        self.app, self.process, self.context = app, process, context   # process: a TokenizerProcess

    async def __call__(self, scope, receive, send):
        length = dict(scope.get("headers", ())).get(b"content-length", b"")
        if scope["type"] != "http" or scope["method"] != "POST" or int(length or 0) <= BIG_BODY_BYTES:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:   # kept as the chunks came: joining 10 MB here would be a stall of its own
            message = await receive()
            if message["type"] != "http.request":   # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        too_long = await self.process.too_long(list(chunks), self.context)
        if too_long is not None:
            param, chars, fewest = too_long
            e = APIError(400, f"{param} has {chars} characters, so at least {fewest} tokens, but this model's "
                              f"context is {self.context} tokens; shorten it", param, "context_length_exceeded")
            return await error_response(e, scope["path"])(scope, receive, send)

        async def replay():   # the body again, chunk by chunk, then whatever comes next (a disconnect)
            if chunks:
                body = chunks.pop(0)
                return {"type": "http.request", "body": body, "more_body": bool(chunks)}
            return await receive()
        await self.app(scope, replay, send)


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
    "Authorization: Bearer KEY" or Anthropic's "x-api-key: KEY" (the page asks the user for the key
    and sends it itself)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            header, x_api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
            scheme, _, given = header.strip().partition(b" ")
            # the scheme's name is case-insensitive (RFC 7235): "bearer KEY" is as good as "Bearer KEY"
            bearer = scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), self.expected)
            if not bearer and not (x_api_key is not None and secrets.compare_digest(x_api_key.strip(), self.expected)):
                said = "the API key was refused" if header or x_api_key is not None else "no API key was sent"
                e = APIError(401, f"{said}: send the server's --api-key as 'Authorization: Bearer KEY' or "
                                  f"'x-api-key: KEY'", None, "invalid_api_key")
                return await error_response(e, scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)
