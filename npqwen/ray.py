"""npqwen on Ray Serve: replicas of `npqwen serve` on many machines, routed by shared prefix (docs/scale-out.md).

    serve run npqwen.ray:build_app model=Qwen/Qwen3-0.6B num_replicas=2

Two deployments, the way Ray Serve LLM splits an OpenAI server:

    HTTP -> Ray's proxy -> Front (any replica: reads the body, picks the text that routes it)
              -> Ray's request router (PrefixCacheAffinityRouter: the replica whose prefix cache holds the
                 longest part of this text, unless the replicas' queues differ by more than a threshold)
              -> Replica (one `npqwen serve` app: its own model, engine, prefix cache) -> the answer,
                 streamed back chunk by chunk through Front

Each replica runs the very FastAPI app of `npqwen serve` (npqwen/server/api_server.py), called in
process as an ASGI app, so every route answers as it does without Ray. A replica that dies (SIGKILL)
ends its open streams with an error event in its API's shape; a request it had not begun answering is
sent to another replica. Ray starts a new replica in its place.
"""
import asyncio
import difflib
import json
from dataclasses import dataclass

from .errors import NpqwenError

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import RequestRouter
except ImportError as e:   # noqa: F841  (said when build_app is called)
    raise NpqwenError("npqwen.ray needs Ray Serve: pip install 'npqwen[ray]'") from None

# Ray's prefix-affinity router, from its module: the public `ray.serve.llm` path imports vLLM first.
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
LOAD_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
SERVE_KEYS = ("num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests",
              "health_check_period_s", "health_check_timeout_s", "router", "imbalanced_threshold")
ROUTERS = ("prefix", "load", "round_robin")
NOT_UNDER_RAY = {"host": "Ray's proxy listens (serve start --http-host, or http_options in the config file)",
                 "port": "Ray's proxy listens (serve start --http-port, or http_options in the config file)",
                 "log_level": "Ray Serve logs each replica (logging_config in the config file)",
                 "tensor_parallel": "a replica is one process here; use TP with `npqwen serve` (docs/parallel.md)"}
REPLICA_HEADER = "x-npqwen-replica"
LOST = "the replica serving this request was lost (its process died); send the request again"


# -- the builder: `serve run npqwen.ray:build_app key=value ...` --

def build_app(args: dict):
    """The Serve application for `args`: `npqwen serve`'s options by their names (model, served_model_name,
    api_key, kv_cache_tokens, ...; values as given on the command line or typed in a config file), and
    Serve's: num_replicas, autoscaling_config, ray_actor_options, max_ongoing_requests,
    health_check_period_s, health_check_timeout_s; router: prefix (default), load (Ray's power of two
    choices) or round_robin; imbalanced_threshold: the difference of queue lengths above which prefix
    routing gives way to load (default 4). Every key is checked here, before any replica starts."""
    args = dict(args)
    options = {k: args.pop(k) for k in list(args) if k in SERVE_KEYS}
    argv = serve_argv(args)
    server_args(argv)   # the options' own checks, now
    router = options.pop("router", "prefix")
    if router not in ROUTERS:
        raise NpqwenError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    threshold = float(options.pop("imbalanced_threshold", 4))
    deployment = {"max_ongoing_requests": 64, "health_check_period_s": 2, "health_check_timeout_s": 30}
    for key, value in options.items():
        deployment[key] = int(value) if key in ("num_replicas", "max_ongoing_requests") else \
            float(value) if key.startswith("health_check") else json_value(key, value)
    router_class = {"prefix": PREFIX_ROUTER, "load": LOAD_ROUTER, "round_robin": RoundRobinRouter}[router]
    kwargs = {"imbalanced_threshold": threshold} if router == "prefix" else {}
    deployment["request_router_config"] = RequestRouterConfig(request_router_class=router_class,
                                                              request_router_kwargs=kwargs)
    replica = Replica.options(**deployment).bind(argv)
    return Front.bind(replica)


def serve_argv(args: dict) -> list[str]:
    """`npqwen serve`'s command line for `args` {option name: value}; a key it has not is an error naming the
    nearest one."""
    actions = {a.dest: a for a in serve_parser()[1]._actions if a.option_strings and a.dest != "help"}
    argv = []
    for key, value in args.items():
        key = key.replace("-", "_")
        if key in NOT_UNDER_RAY:
            raise NpqwenError(f"{key} does not apply under Ray Serve: {NOT_UNDER_RAY[key]}")
        if key not in actions:
            near = difflib.get_close_matches(key, [*actions, *SERVE_KEYS], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise NpqwenError(f"npqwen.ray:build_app has no option {key!r}{hint} (its keys are `npqwen serve`'s "
                              f"options and Serve's: {', '.join(SERVE_KEYS)})")
        action = actions[key]
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:   # a switch: true / false, as a word or a boolean
            if str(value).lower() in ("true", "1", "yes"):
                argv.append(flag)
            elif str(value).lower() not in ("false", "0", "no"):
                raise NpqwenError(f"{key} is a switch: give true or false, got {value!r}")
        else:
            for one in value if isinstance(value, list) else [value]:
                argv += [flag, json.dumps(one) if isinstance(one, dict) else str(one)]
    return argv


def json_value(key: str, value):
    """A Serve option that is an object (autoscaling_config, ray_actor_options): typed in a config file,
    JSON text on `serve run`'s command line."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise NpqwenError(f"{key} must be a JSON object, got {value!r} ({e})") from None
    if not isinstance(value, dict):
        raise NpqwenError(f"{key} must be an object, got {value!r}")
    return value


class OptionError(NpqwenError):
    """A value `npqwen serve`'s parser refuses."""


def serve_parser():
    """`npqwen`'s argument parser with only its serve command, and that command's: raising instead of exiting."""
    import argparse

    from .cli import serve as serve_command

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise OptionError(f"npqwen.ray:build_app: {message.replace('--', '').replace('-', '_')}")

    top = Parser(prog="npqwen")
    commands = top.add_subparsers(dest="command", parser_class=Parser)
    serve_command.add_parser(commands)
    return top, commands.choices["serve"]


def server_args(argv: list[str]):
    """The parsed and checked options of one replica's `npqwen serve`."""
    from .cli.serve import check_server_options

    args = serve_parser()[0].parse_args(["serve", *argv])
    check_server_options(args)
    return args


# -- one HTTP request, as Front hands it to a replica --

@dataclass
class Call:
    """An HTTP request whole: what the replica's ASGI app receives. `prompt` is the text Ray's prefix router
    matches (it reads a `prompt` attribute): the request's messages or prompt, in order."""
    method: str
    path: str
    query_string: bytes
    headers: list
    body: bytes
    prompt: str


def routed_text(path: str, body: bytes) -> str:
    """The text whose prefix decides the replica: the contents of a chat's messages (system first), a
    completion's prompt, a Responses input, an embedding's input, a rerank's query; else the path."""
    try:
        fields = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError):
        fields = {}
    if not isinstance(fields, dict):
        fields = {}
    parts = [fields.get(key) for key in ("system", "instructions", "messages", "prompt", "input", "query")]
    return text_of(parts) or path


def text_of(value) -> str:
    """The strings inside a JSON value, concatenated in order: the contents, not the keys."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(text_of(v) for v in value)
    if isinstance(value, dict):
        return "".join(text_of(value[k]) for k in ("content", "text", "input", "output") if k in value)
    return ""


# -- the replicas: `npqwen serve`'s app, called in process --

@serve.deployment
class Replica:
    """One `npqwen serve`: its model, engine and FastAPI app. `__call__` streams an HTTP answer: first
    {"status", "headers"}, then the body's chunks."""

    def __init__(self, argv: list[str]):
        from .cli.serve import server_app

        self.app, _ = server_app(server_args(argv))
        self.name = serve.get_replica_context().replica_id.unique_id
        self.started = None
        self.mirrored = {}

    async def start(self):
        """Run the app's lifespan (the engine thread starts), once; then mirror its metrics into Ray's."""
        if self.started is None:
            self.started = asyncio.ensure_future(lifespan_startup(self.app))
            asyncio.ensure_future(self.mirror_metrics())
        await self.started

    async def __call__(self, call: Call):
        await self.start()
        queue, gone = asyncio.Queue(), asyncio.Event()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
                 "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "root_path": "",
                 "query_string": call.query_string, "headers": [(k.encode(), v.encode()) for k, v in call.headers],
                 "client": ("ray", 0), "server": ("npqwen", 0), "state": {}}
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()   # the client went away: the app aborts its requests
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(self.app(scope, receive, queue.put))
        try:
            while True:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait([get, task], return_when=asyncio.FIRST_COMPLETED)
                if not get.done():   # the app ended without a message more: it raised
                    get.cancel()
                    task.result()
                    return
                message = get.result()
                if message["type"] == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield {"status": message["status"], "headers": [*headers, (REPLICA_HEADER, self.name)]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:
            gone.set()
            await asyncio.wait([task], timeout=5)

    async def check_health(self):
        """Ray's health check: the engine thread is alive (after it started)."""
        if self.started is not None and self.started.done() and not self.app.state.loop.alive:
            raise RuntimeError("npqwen's engine thread stopped")

    async def mirror_metrics(self):
        """Every 2 s, the values of npqwen's /metrics as Ray Serve gauges `npqwen_*` (Ray adds the replica,
        deployment and application tags), so that Ray's metrics have them per replica."""
        from ray.serve.metrics import Gauge

        while True:
            for family in self.app.state.metrics.registry.collect():
                for sample in family.samples:
                    if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                        continue
                    name = "npqwen_" + sample.name.split(":", 1)[-1]
                    keys = tuple(sorted(sample.labels))
                    if (name, keys) not in self.mirrored:
                        self.mirrored[name, keys] = Gauge(name, description=family.documentation, tag_keys=keys)
                    self.mirrored[name, keys].set(sample.value, tags=dict(sample.labels) or None)
            await asyncio.sleep(2)


async def lifespan_startup(app):
    """Start an ASGI app's lifespan (FastAPI's startup), as uvicorn does, and leave it running."""
    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    app.state.lifespan = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                   inbox.get, outbox.put))
    message = await outbox.get()
    if message["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"npqwen's app did not start: {message.get('message')}")


# -- the entry: reads the request, routes it, streams the answer back --

@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class Front:
    """Any number of these take the HTTP requests from Ray's proxy and send each to a replica through the
    request router; its answer streams back through here."""

    def __init__(self, replica):
        self.replica = replica

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        from .server.http import DEFAULT_MAX_BODY_BYTES

        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > DEFAULT_MAX_BODY_BYTES:
                return JSONResponse(error_body(413, f"the body is over {DEFAULT_MAX_BODY_BYTES} bytes"), 413)
        call = Call(request.method, request.url.path, request.url.query.encode(), list(request.headers.items()),
                    bytes(body), routed_text(request.url.path, bytes(body)))
        for attempt in range(3):   # a replica lost before it answered: another one takes the request
            answer = self.replica.options(stream=True).remote(call)
            try:
                head = await answer.__anext__()
                break
            except StopAsyncIteration:
                return JSONResponse(error_body(502, "the replica ended without an answer"), 502)
            except ray.exceptions.RayError:
                await asyncio.sleep(0.5 * attempt)
        else:
            return JSONResponse(error_body(503, LOST), 503)
        headers = {k: v for k, v in head["headers"] if k.lower() != "content-length"}

        async def chunks():
            try:
                async for chunk in answer:
                    yield chunk
            except ray.exceptions.RayError:   # lost while answering: the stream ends with an error event
                if "text/event-stream" in headers.get("content-type", ""):
                    yield lost_event(call.path)

        return StreamingResponse(chunks(), status_code=head["status"], headers=headers)


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": str(status)}}


def lost_event(path: str) -> bytes:
    """The last event of a stream whose replica died, in the shape its API ends a stream with an error."""
    if path.startswith("/v1/messages"):
        return ("event: error\ndata: " + json.dumps({"type": "error", "error": {"type": "api_error", "message": LOST}})
                + "\n\n").encode()
    if path.startswith("/v1/responses"):
        return ("event: error\ndata: " + json.dumps({"type": "error", "code": "server_error", "message": LOST,
                                                     "param": None}) + "\n\n").encode()
    return f"data: {json.dumps(error_body(500, LOST))}\n\ndata: [DONE]\n\n".encode()


# -- round robin: the baseline the prefix router is measured against (tools/bench's scale_out suite) --

class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn, whatever it holds."""

    def initialize_state(self, **kwargs):
        self.turn = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self.turn += 1
        return [[ordered[self.turn % len(ordered)]]] if ordered else []
