"""`npqwen serve`: an OpenAI-compatible HTTP server (npqwen/server/) on one batched engine."""
import json
import signal

from ..errors import NpqwenError
from ..features import load_labels, load_sae
from .common import add_engine_sizes, add_thinking_budget, engine_sizes, load_model, lora_options, model_options
from .parallel import add_option, check_group, watch_server

TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "documents")   # set by the server, not by the option


def add_parser(commands):
    p = commands.add_parser("serve", parents=[model_options(), lora_options()],
                            help="an OpenAI-compatible HTTP server (needs npqwen[serve])",
                            description="Serve the model over HTTP with OpenAI's API (/v1/chat/completions, "
                                        "/v1/completions, /v1/responses, /v1/models), plus /tokenize, /detokenize, "
                                        "/health, /metrics and /openapi.json. Many clients at once, through one "
                                        "batched engine. Ctrl-C stops.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 opens it to the network (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: none, anyone who can connect)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the --model value)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests before new ones get 429 (default: 256)")
    p.add_argument("--allowed-origins", metavar="ORIGINS",
                   help="web pages from these origins may call the API from a browser (CORS), comma-separated "
                        "('https://app.example,http://localhost:3000'), '*' for any (default: none but the "
                        "server's own)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="let clients load and unload LoRA adapters from directories on this machine (POST "
                        "/v1/load_lora_adapter, /v1/unload_lora_adapter); default: only the --lora ones")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; info logs each request (default: info)")
    p.add_argument("--default-chat-template-kwargs", metavar="JSON",
                   help="the chat template's variables when a request does not set them, as a JSON object: "
                        "'{\"enable_thinking\": false}' turns thinking off by default (default: none)")
    p.add_argument("--sae", action="append", default=[], metavar="[NAME=]PATH",
                   help="an SAE or transcoder (a Qwen-Scope layer{n}.sae.pt, a SAELens folder, a circuit-tracer "
                        "layer_{n}.safetensors) that requests' feature_edits and the page's features view name by "
                        "NAME (default NAME: the file or folder's name); repeatable (default: none)")
    p.add_argument("--feature-labels", action="append", default=[], metavar="[NAME=]FILE",
                   help="descriptions of the features of the --sae called NAME, from a Neuronpedia export (default "
                        "NAME: the only --sae); repeatable (default: none)")
    add_thinking_budget(p)
    p.add_argument("--allow-generation", action="store_true",
                   help="serve chat and completions on an embedding model too (default: refused with a 400)")
    add_engine_sizes(p.add_argument_group("engine sizes"))
    add_option(p)
    p.set_defaults(run=cmd_serve)


def cmd_serve(args) -> int:
    """Load, make the engine, bind the port, and serve until Ctrl-C (uvicorn stops cleanly on SIGINT)."""
    import socket

    try:
        import uvicorn

        from ..server import api_server  # noqa: F401  (the serve extra's packages)
    except ImportError as e:
        raise NpqwenError(f"npqwen serve needs the serve extra: pip install 'npqwen[serve]' ({e.name} is "
                          f"missing)") from None
    if not 0 <= args.port <= 65535:
        raise NpqwenError(f"--port must be in 0 .. 65535, got {args.port}")
    check_server_options(args)
    try:   # bound before the (slow) load, so that a port in use is said at once
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(2048)   # clients that come before uvicorn takes the socket wait in the backlog
    except OSError as e:
        raise NpqwenError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pick another --port "
                          f"(0 picks a free one) or --host") from None
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    app, seconds = server_app(args, lambda app: print(
        f"npqwen: serving {app.state.model_name} at {url}/v1, the web page at {url}/ (loaded in {seconds:.1f} s; "
        f"KV cache {app.state.kv_positions} positions); Ctrl-C stops", flush=True))
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=3))

    def handle_exit(sig, frame):
        # Ctrl-C or SIGTERM: open requests end now (a stream gets an error event, then [DONE]), then
        # uvicorn shuts down (a second Ctrl-C: at once). Unlike uvicorn's own handler this does not
        # raise the signal again afterwards, which would interrupt the shutdown with a traceback.
        app.state.loop.stop_soon()
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    server.handle_exit = handle_exit
    watch_server(args, app.state.loop, server)   # tensor parallel: a rank that dies or fails stops the server
    server.run(sockets=[sock])
    print("npqwen: stopped", flush=True)
    check_group(args)
    return 0




def check_server_options(args):
    """The options checked before the (slow) load; `npqwen serve` and npqwen.ray's build_app both call this."""
    if args.max_queue < 1:
        raise NpqwenError(f"--max-queue must be >= 1, got {args.max_queue}")
    template_kwargs_option(args.default_chat_template_kwargs)
    sae_and_label_paths(args)
    if args.thinking_budget is not None and args.thinking_budget < 0:
        raise NpqwenError(f"--thinking-budget must be >= 0 (reasoning tokens), got {args.thinking_budget}")


def server_app(args, on_ready=None):
    """Load the model, make its engine and the FastAPI app that serves it: (app, load seconds).
    on_ready(app) runs once the app is up (its lifespan started). Used by `npqwen serve` and by each
    Ray Serve replica (npqwen/ray.py)."""
    from ..engine import Engine
    from ..server.api_server import create_app

    sae_paths, label_paths = sae_and_label_paths(args)
    labels = {name: load_labels(path) for name, path in label_paths.items()}
    llm, seconds = load_model(args, chat_template=True)
    saes = {name: load_sae(path, llm.config) for name, path in sae_paths.items()}
    engine = Engine(llm, **engine_sizes(args))
    name = args.served_model_name or args.model
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    app = create_app(llm, engine, name, api_key=args.api_key, max_queue=args.max_queue,
                     on_ready=None if on_ready is None else lambda: on_ready(app), allowed_origins=origins or None,
                     template_kwargs=template_kwargs_option(args.default_chat_template_kwargs),
                     thinking_budget=args.thinking_budget, allow_generation=args.allow_generation,
                     allow_runtime_lora=args.allow_runtime_lora, saes=saes, labels=labels)
    app.state.model_name, app.state.kv_positions = name, engine.pool.num_pages * engine.page_size
    return app, seconds


def sae_and_label_paths(args) -> tuple[dict, dict]:
    """--sae and --feature-labels as {name: path} each, every label file paired with an SAE."""
    sae_paths, label_paths = named_paths(args.sae, "--sae"), named_paths(args.feature_labels, "--feature-labels")
    if label_paths and not sae_paths:
        raise NpqwenError("--feature-labels goes with --sae: the labels describe an SAE's features")
    if None in label_paths:   # no NAME: the only SAE's
        if len(sae_paths) != 1:
            raise NpqwenError("--feature-labels FILE without NAME= needs exactly one --sae; write NAME=FILE")
        label_paths[next(iter(sae_paths))] = label_paths.pop(None)
    for name in label_paths:
        if name not in sae_paths:
            raise NpqwenError(f"--feature-labels {name}=...: no --sae is called {name!r}; they are "
                              f"{', '.join(sae_paths)}")
    return sae_paths, label_paths


def named_paths(values: list[str], option: str) -> dict:
    """[NAME=]PATH options as {name: path}; without NAME=, --sae is named by its file or folder and
    --feature-labels by None (the only SAE's)."""
    from pathlib import Path

    named = {}
    for value in values:
        name, sep, path = value.rpartition("=")
        if not sep:
            name = Path(path).name if option == "--sae" else None
        if name in named:
            raise NpqwenError(f"{option}: {name or 'an unnamed file'} is given twice; write NAME=PATH to tell "
                              f"them apart")
        named[name] = path
    return named


def template_kwargs_option(text: str | None) -> dict:
    """--default-chat-template-kwargs: a JSON object of the template's variables, checked."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise NpqwenError(f"--default-chat-template-kwargs is not valid JSON ({e}); give an object such as "
                          f"'{{\"enable_thinking\": false}}'") from None
    if not isinstance(value, dict):
        raise NpqwenError(f"--default-chat-template-kwargs must be a JSON object, got {text!r}")
    own = [k for k in value if k in TEMPLATE_OWN]
    if own:
        raise NpqwenError(f"--default-chat-template-kwargs cannot set {own[0]!r}: the server sets it per request")
    if not isinstance(value.get("enable_thinking", True), bool):
        raise NpqwenError(f"--default-chat-template-kwargs: enable_thinking must be true or false, got "
                          f"{value['enable_thinking']!r}")
    return value
