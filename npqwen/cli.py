"""The `npqwen` command: generate, chat (and bench, inspect, trace, compare).

A mistake the user can fix (bad path, bad value, prompt too long) prints one line on stderr
and exits with status 1, without a traceback.
"""
import argparse
import codecs
import contextlib
import io
import json
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from .errors import NpqwenError
from .hub import DEFAULT_MODEL


class OutputError(NpqwenError):
    """stdout cannot take the output (a full disk, /dev/full, a closed terminal)."""


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        # Text the terminal's encoding cannot show (PYTHONIOENCODING=latin-1 and a Chinese answer)
        # prints as "?" instead of ending the run in a UnicodeEncodeError.
        sys.stdout.reconfigure(errors="replace")
    try:
        code = args.run(args) or 0
        write_out("")   # flush now: a full disk shows as one line here, not as a traceback at exit
        return code
    except NpqwenError as e:
        print(f"npqwen: error: {e}", file=sys.stderr)
        if isinstance(e, OutputError):   # what is still buffered would fail again at exit: let it go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:   # e.g. `npqwen generate ... | head`
        sys.stderr.close()
        return 0


def write_out(text: str):
    """Write to stdout and flush; a failed write (no space left) is one clear error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write the output to stdout ({e.strerror or e})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npqwen", description="Qwen3 inference in plain NumPy / CuPy.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"npqwen {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Every option's help ends with its default: "(default: ...)", written out where None means
    # "the checkpoint's value" or "off".
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", "-m", default=DEFAULT_MODEL,
                       help=f"checkpoint directory, hub id in the HF cache (downloaded if missing), or 'tiny' "
                            f"(default: {DEFAULT_MODEL})")
    model.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default: cpu)")
    model.add_argument("--dtype", default="float32",
                       help="compute dtype; cpu: float32, float64; cuda: also float16 (default: float32)")

    sampling = argparse.ArgumentParser(add_help=False)
    checkpoint = "(default: generation_config.json's, else %s)"
    sampling.add_argument("--max-new-tokens", "-n", type=int, default=512,
                          help="most tokens to generate (default: 512)")
    sampling.add_argument("--temperature", "-t", type=float, help="0 is greedy " + checkpoint % "0")
    sampling.add_argument("--top-k", type=int, help="0 is off " + checkpoint % "0")
    sampling.add_argument("--top-p", type=float, help="1 is off " + checkpoint % "1")
    sampling.add_argument("--min-p", type=float, help="0 is off " + checkpoint % "0")
    sampling.add_argument("--repetition-penalty", type=float, help="1 is off " + checkpoint % "1")
    sampling.add_argument("--presence-penalty", type=float, help="0 is off (default: 0)")
    sampling.add_argument("--frequency-penalty", type=float,
                          help="subtracted once per earlier occurrence of a token, OpenAI's rule; 0 is off (default: 0)")
    sampling.add_argument("--seed", type=int, help="for a reproducible draw (default: none, a fresh draw each run)")
    sampling.add_argument("--stop", action="append",
                          help="stop string (repeatable); not included in the output (default: none)")
    sampling.add_argument("--no-think", action="store_true",
                          help="enable_thinking=False in the chat template (default: thinking on)")
    sampling.add_argument("--system", help="system message (default: none)")

    p = commands.add_parser("generate", parents=[model, sampling],
                            help="complete one prompt, streaming; or a file of prompts, batched")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", "-p", help="the prompt ('-' reads it from stdin)")
    source.add_argument("--prompts-file", metavar="FILE",
                        help="many prompts, run together through one engine: one per line, or JSONL lines with "
                             "\"prompt\" or \"messages\" and optional sampling fields ('-' reads stdin)")
    p.add_argument("--raw", action="store_true",
                   help="plain completion: do not apply the chat template (default: the chat template)")
    batch = p.add_argument_group("with --prompts-file")
    batch.add_argument("--output", "-o", metavar="OUT.jsonl", help="write the results here (default: stdout)")
    add_engine_sizes(batch)
    p.set_defaults(run=cmd_generate)

    p = commands.add_parser("serve", parents=[model], help="an OpenAI-compatible HTTP server (needs npqwen[serve])",
                            description="Serve the model over HTTP with OpenAI's API (/v1/chat/completions, "
                                        "/v1/completions, /v1/models), plus /tokenize, /detokenize, /health and "
                                        "/metrics. Many clients at once, through one batched engine. Ctrl-C stops.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 opens it to the network (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: none, anyone who can connect)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the --model value)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests before new ones get 429 (default: 256)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; info logs each request (default: info)")
    add_engine_sizes(p.add_argument_group("engine sizes"))
    p.set_defaults(run=cmd_serve)

    p = commands.add_parser("chat", parents=[model, sampling], help="interactive multi-turn chat",
                            description="Multi-turn chat. /reset clears the history; /exit, Ctrl-D or Ctrl-C at "
                                        "the prompt quits; Ctrl-C during an answer stops that answer (it is not "
                                        "kept in the history). Arrow keys edit the line and recall earlier ones.")
    p.set_defaults(run=cmd_chat)

    p = commands.add_parser("inspect", parents=[model], help="the config and every weight, with parameter counts")
    p.set_defaults(run=cmd_inspect)

    one_pass = argparse.ArgumentParser(add_help=False)
    one_pass.add_argument("--prompt", "-p", required=True, help="the input text (required)")
    one_pass.add_argument("--chat", action="store_true",
                          help="apply the chat template to the prompt first (default: the prompt as is)")

    p = commands.add_parser("trace", parents=[model, one_pass],
                            help="one forward pass: every step's shape, dtype and statistics")
    p.add_argument("--layers", help="only these layers, e.g. 0,3,5-7 (default: all)")
    p.add_argument("--save", metavar="FILE.npz",
                   help="keep every intermediate array, under its name; .npz is added if missing (default: none)")
    p.add_argument("--plot-attention", metavar="FILE.png",
                   help="heatmap of one layer's attention probabilities (default: none)")
    p.add_argument("--layer", type=int, help="the layer to plot (required with --plot-attention)")
    p.add_argument("--head", type=int, help="the head to plot (default: the mean over heads)")
    p.set_defaults(run=cmd_trace)

    p = commands.add_parser("compare", parents=[model, one_pass],
                            help="module-by-module difference from HF transformers (needs torch)")
    p.add_argument("--tol", type=float, default=1e-3,
                   help="tolerance, relative to max |HF| (at least 1) (default: 0.001)")
    p.set_defaults(run=cmd_compare)
    return parser


def check_device_dtype(args):
    """npqwen.load's device and dtype checks, before anything slow (inspect never calls load)."""
    from .llm import check_device_dtype as check

    check(args.device, args.dtype)


def check_writable(path: str, option: str):
    """Before the slow work: `path` must be a file name in a folder that exists and can be written."""
    target, folder = Path(path), Path(path).parent
    if target.is_dir():
        raise NpqwenError(f"{path}: cannot write it ({option}): it is a directory; give a file name")
    if not folder.is_dir():
        raise NpqwenError(f"{path}: cannot write it ({option}): no such directory {str(folder)!r}")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise NpqwenError(f"{path}: cannot write it ({option}): permission denied")


# check_request's stand-in for a model not loaded yet: the context length is checked later, with the prompt.
ANY_CONTEXT = SimpleNamespace(max_position_embeddings=sys.maxsize)


def add_engine_sizes(group):
    group.add_argument("--max-batch-size", type=int, help="most requests in one step (default: the engine's, 64)")
    group.add_argument("--max-batched-tokens", type=int, help="most tokens in one step (default: the engine's, 512)")
    group.add_argument("--kv-cache-tokens", type=int,
                       help="KV-cache positions (default: the engine's, half the free memory)")
    group.add_argument("--page-size", type=int, help="positions per KV-cache page (default: the engine's, 256)")
    group.add_argument("--no-prefix-cache", action="store_true", help="do not reuse pages of shared prefixes "
                       "(default: reuse them)")


def engine_sizes(args) -> dict:
    """npqwen.Engine's keyword arguments given on the command line."""
    sizes = {k: getattr(args, k) for k in ENGINE_SIZES if getattr(args, k) is not None}
    return {**sizes, **({"prefix_cache": False} if args.no_prefix_cache else {})}


def check_sampling_args(args):
    """The command line's sampling values, with the checks every request gets, before the (slow) load.

    The checkpoint's own defaults (generation_config.json) are checked when the request is made."""
    from .generate import check_request
    from .sampling import sampling_params

    kwargs = sampling_kwargs(args)
    check_request(ANY_CONTEXT, [0], kwargs.pop("max_new_tokens"), kwargs.pop("stop"))
    sampling_params({}, **kwargs)


def load_model(args, chat_template: bool = False):
    """The model, and the seconds it took to load; a checkpoint without a tokenizer is refused first
    (every command here starts from text), as is one without a chat template when `chat_template`."""
    from . import load
    from .hub import resolve_model

    check_device_dtype(args)
    started = time.perf_counter()
    model = args.model
    if model != "tiny":
        model = resolve_model(model).resolve()   # absolute: a local folder named "tiny" is not the built-in one
        if not (model / "tokenizer.json").is_file():
            raise NpqwenError(f"{model}: no tokenizer.json, so the text cannot be encoded; the checkpoint directory "
                              f"needs the model's tokenizer.json and tokenizer_config.json (from the same hub repo)")
    llm = load(model, device=args.device, dtype=args.dtype)
    if chat_template and llm.tokenizer.chat_template is None:
        instead = {"generate": ", or use --raw for a plain completion", "chat": ""}.get(args.command,
                                                                                       ", or leave out --chat")
        raise NpqwenError(f"{model}: tokenizer_config.json has no chat_template (nor is there a chat_template.jinja), "
                          f"so messages cannot be formatted; add the model's tokenizer_config.json{instead}")
    return llm, time.perf_counter() - started


def sampling_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, seed=args.seed, stop=args.stop,
                frequency_penalty=args.frequency_penalty)


def checked_text(text: str, what: str) -> str:
    """Refuse text that is not valid UTF-8 (Python keeps undecodable argv bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise NpqwenError(f"the {what} is not valid UTF-8; fix its encoding") from None
    return text


def cmd_generate(args) -> int:
    if args.prompts_file is not None:
        return generate_file(args)
    given = [f"--{name.replace('_', '-')}" for name in ("output", *ENGINE_SIZES) if getattr(args, name) is not None]
    if args.no_prefix_cache:
        given.append("--no-prefix-cache")
    if given:
        raise NpqwenError(f"{given[0]} goes with --prompts-file, not --prompt")
    if args.prompt == "-":
        try:
            args.prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise NpqwenError(f"the prompt on stdin is not valid UTF-8 ({e})") from None
    prompt = checked_text(args.prompt, "prompt")
    system = system_messages(args)
    check_sampling_args(args)   # a bad value shows before the (slow) load
    llm, load_seconds = load_model(args, chat_template=not args.raw)
    kwargs = sampling_kwargs(args)
    if not args.raw:
        prompt = llm.chat_prompt(system + [{"role": "user", "content": prompt}], enable_thinking=not args.no_think)
    print_stats(stream_to_stdout(llm, prompt, kwargs), load_seconds)
    return 0


def system_messages(args) -> list[dict]:
    return [{"role": "system", "content": checked_text(args.system, "system message")}] if args.system else []


def stream_to_stdout(llm, prompt, kwargs, stop_requested=None):
    """Generate, writing each text piece as it comes; the GenerationResult at the end.

    `stop_requested` (chat: Ctrl-C was pressed) is asked after every piece; when it says yes the
    stream is closed, which aborts its request in the engine, and the result is None."""
    from .generate import GenerationResult

    result = GenerationResult("", [], "length")
    pieces = llm.stream(prompt, result=result, **kwargs)   # nothing runs until the first piece is asked for
    stopped = stop_requested is not None and stop_requested()
    if not stopped:
        for piece in pieces:
            write_out(piece)
            if stop_requested is not None and stop_requested():
                stopped = True
                break
    if stopped:
        pieces.close()   # the generator's `finally` aborts the request and frees its pages
        write_out("\n")
        return None
    write_out("\n")
    return result


@contextlib.contextmanager
def ctrl_c_sets_a_flag():
    """Inside, a first Ctrl-C only sets a flag (read between two text pieces), so it never lands in the
    middle of an engine step; a second one raises KeyboardInterrupt as usual (and quits)."""
    pressed = []

    def on_ctrl_c(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "seed", "stop", "frequency_penalty")
ENGINE_SIZES = ("max_batch_size", "max_batched_tokens", "kv_cache_tokens", "page_size")   # npqwen.Engine's


@dataclass
class FilePrompt:
    """One prompt of a --prompts-file, with the line it came from."""
    line: int                                      # 1-based line number in the file
    prompt: str | None = None                      # a plain line, or JSONL "prompt": templated unless --raw
    messages: list | None = None                   # JSONL "messages": always templated
    sampling: dict = field(default_factory=dict)   # JSONL sampling fields: they override the command line


def read_prompts_file(path: str) -> list[FilePrompt]:
    """The prompts in FILE: JSONL if every non-empty line is a JSON object, else one prompt per line."""
    name = file_name(path)
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise NpqwenError(f"{name}: cannot read it ({e.strerror or e})") from None
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise NpqwenError(f"{name} line {line}: not valid UTF-8 (byte {data[e.start]:#04x}); "
                          f"fix the file's encoding") from None
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise NpqwenError(f"{name}: no prompts in it (the file is empty)")
    objects = [json_object(line) for _, line in lines]
    if any(o is None for o in objects):
        if any(o is not None for o in objects):   # most likely JSONL with a broken line: say how it was read
            n = next(n for (n, _), o in zip(lines, objects) if o is None)
            print(f"npqwen: {name} line {n} is not a JSON object, so every line is read as a plain-text prompt",
                  file=sys.stderr)
        return [FilePrompt(n, prompt=line) for n, line in lines]
    return [file_prompt(f"{name} line {n}", n, o) for (n, _), o in zip(lines, objects)]


def file_name(path: str) -> str:
    return "stdin" if path == "-" else path


def json_object(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def file_prompt(where: str, n: int, obj: dict) -> FilePrompt:
    """A JSONL line: "prompt" (a string) or "messages" (a chat), and sampling fields (null = not given)."""
    unknown = [k for k in obj if k not in ("prompt", "messages", *SAMPLING_FIELDS)]
    if unknown:
        raise NpqwenError(f"{where}: unknown field {unknown[0]!r}; a line has \"prompt\" or \"messages\" and "
                          f"optionally {', '.join(SAMPLING_FIELDS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise NpqwenError(f"{where}: needs \"prompt\" (a string) or \"messages\" (a list of chat messages), "
                          f"{'not both' if 'prompt' in obj else 'and has neither'}")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if "prompt" in obj and not isinstance(prompt, str):
        raise NpqwenError(f"{where}: \"prompt\" must be a string, got {json.dumps(prompt)[:60]}")
    if "messages" in obj and not (isinstance(messages, list) and messages
                                  and all(isinstance(m, dict) for m in messages)):
        raise NpqwenError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                          f"objects, got {json.dumps(messages)[:60]}")
    try:   # JSON can escape a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text holds
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise NpqwenError(f"{where}: a string in it is not valid UTF-8 (an unpaired surrogate escape)") from None
    return FilePrompt(n, prompt, messages, {k: v for k, v in obj.items() if k in SAMPLING_FIELDS and v is not None})


def generate_file(args) -> int:
    """--prompts-file: every prompt through one engine; the results as JSONL, in input order."""
    from .engine import Engine

    name = file_name(args.prompts_file)
    # The command line's values alone first, so a bad one is not blamed on line 1; then the file's own
    # mistakes; all before the (slow) load.
    check_sampling_args(args)
    system_messages(args)
    if args.output:
        check_writable(args.output, "--output")
    prompts = read_prompts_file(args.prompts_file)
    llm, load_seconds = load_model(args, chat_template=not args.raw or any(p.messages for p in prompts))
    engine = Engine(llm, **engine_sizes(args))
    defaults = sampling_kwargs(args)
    # Every request is added (and so checked) before the first step; one bad line cancels them all.
    request_ids = []
    for p in prompts:
        try:
            request_ids.append(engine.add_request(file_prompt_text(llm, args, p), **{**defaults, **p.sampling}))
        except NpqwenError as e:
            for request_id in request_ids:
                engine.abort(request_id)
            raise NpqwenError(f"{name} line {p.line}: {e}") from None
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:
        raise NpqwenError(f"{args.output}: cannot write it ({e.strerror or e})") from None
    index = {request_id: i for i, request_id in enumerate(request_ids)}
    budget = {request_id: engine.requests[request_id].max_new_tokens for request_id in request_ids}
    progress = Progress(len(prompts), sum(budget.values()))
    results, written = {}, 0
    try:
        while engine.has_unfinished():
            for o in engine.step():
                progress.advance(len(o.token_ids))
                if o.finished:
                    results[index[o.request_id]] = o.result
                    progress.finish_one(budget[o.request_id] - len(o.result.token_ids))
            if written in results and out is sys.stdout:
                progress.clear()        # a result on the terminal must not land inside the progress line
            while written in results:   # in input order: write each result once those before it are written
                write_record(out, json.dumps(result_record(written, prompts[written], results[written]),
                                             ensure_ascii=False) + "\n", args.output)
                written += 1
            progress.show()
        progress.show(final=True)
    finally:
        if out is not sys.stdout:
            out.close()
    print_batch_stats(list(results.values()), progress.elapsed(), engine.stats, load_seconds)
    if args.output:
        print(f"wrote {written} results to {args.output}", file=sys.stderr)
    return 0


def write_record(out, line: str, output: str | None):
    """One JSON line to --output or stdout, flushed; a failed write (disk full) is one clear error."""
    if out is sys.stdout:
        return write_out(line)
    try:
        out.write(line)
        out.flush()
    except OSError as e:
        raise NpqwenError(f"{output}: cannot write it ({e.strerror or e})") from None


def file_prompt_text(llm, args, p: FilePrompt) -> str:
    """The text the engine gets: a plain or "prompt" line under the chat template unless --raw; messages always."""
    if p.messages is not None:
        return llm.chat_prompt(p.messages, enable_thinking=not args.no_think)
    if args.raw:
        return p.prompt
    return llm.chat_prompt(system_messages(args) + [{"role": "user", "content": p.prompt}],
                           enable_thinking=not args.no_think)


def result_record(i: int, p: FilePrompt, result) -> dict:
    source = {"prompt": p.prompt} if p.messages is None else {"messages": p.messages}
    return {"index": i, **source, "text": result.text, "token_ids": [int(t) for t in result.token_ids],
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "generated_tokens": len(result.token_ids)}


class Progress:
    """done/total, generated tokens/s and ETA on stderr: on a terminal one line redrawn with \\r,
    elsewhere (a log, a pipe) a plain line every PLAIN_EVERY seconds and at the end."""
    TTY_EVERY, PLAIN_EVERY, WIDTH = 0.1, 10.0, 20

    def __init__(self, total: int, budget: int, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total, self.budget = total, budget   # prompts; the most tokens they may generate (max_new_tokens)
        self.done = self.tokens = self.spent = 0  # finished prompts; tokens generated; budget generated or let go
        self.started = time.perf_counter()
        self.shown, self.width = self.started, 0

    def advance(self, tokens: int):
        self.tokens += tokens
        self.spent += tokens

    def finish_one(self, unused: int):
        """A prompt finished, `unused` tokens short of its max_new_tokens (eos or a stop string)."""
        self.done += 1
        self.spent += unused

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        elapsed = self.elapsed()
        fraction = self.spent / self.budget if self.budget and self.done < self.total else 1.0
        filled = round(fraction * self.WIDTH)
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        if self.done == self.total:
            eta = f"took {duration(elapsed)}"
        else:   # as if the rest runs at the speed so far, every prompt using its whole max_new_tokens
            eta = f"ETA {duration(elapsed * (1 - fraction) / fraction)}" if fraction > 0 else "ETA ?"
        return (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} done, "
                f"{self.tokens} tokens, {rate:.1f} tokens/s, {eta}")

    def show(self, final: bool = False):
        now = time.perf_counter()
        if not final and now - self.shown < (self.TTY_EVERY if self.tty else self.PLAIN_EVERY):
            return
        self.shown, text = now, self.line()
        if self.tty:   # redraw in place; spaces wipe what a longer earlier line left
            self.stream.write("\r" + text + " " * max(0, self.width - len(text)) + ("\n" if final else ""))
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self):
        """Wipe the terminal's progress line (before a result is printed to the same terminal)."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def print_batch_stats(results: list, seconds: float, stats: dict, load_seconds: float):
    generated = sum(len(r.token_ids) for r in results)
    reasons = {}
    for r in results:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    lines = [f"load: {load_seconds:.2f} s",
             f"prompts: {len(results)}, {sum(r.prompt_tokens for r in results)} tokens "
             f"({stats['prefix_cache_hit_tokens']} from the prefix cache)",
             f"generation: {generated} tokens in {seconds:.2f} s, {generated / seconds if seconds else 0.0:.1f} "
             f"tokens/s ({', '.join(f'{n} {reason}' for reason, n in sorted(reasons.items()))})",
             f"preemptions: {stats['preemptions']}",
             f"peak memory: {peak_rss_bytes() / 1e9:.3f} GB"]
    print("==========\n" + "\n".join(lines), file=sys.stderr)


def cmd_chat(args) -> int:
    from .llm import split_reasoning

    check_sampling_args(args)   # a bad value shows before the (slow) load
    system = system_messages(args)
    llm, _ = load_model(args, chat_template=True)
    kwargs = sampling_kwargs(args)
    history = list(system)
    line_editing()
    print(f"npqwen chat with {args.model}. /reset clears the history; /exit, Ctrl-D or Ctrl-C quits; "
          f"Ctrl-C during an answer stops it.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):   # Ctrl-D, or Ctrl-C at the prompt: quit
            print(file=sys.stderr)
            return 0
        except UnicodeDecodeError:
            print("npqwen: error: that input is not valid UTF-8; try again", file=sys.stderr)
            continue
        except OSError as e:   # input() writes ">>> " to stdout: a full disk or a closed terminal
            raise OutputError(f"cannot use stdout or stdin ({e.strerror or e})") from None
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history = list(system)
            print("(history cleared)", file=sys.stderr)
            continue
        if not command:
            continue
        try:
            checked_text(line, "message")
            messages = history + [{"role": "user", "content": line}]
            with ctrl_c_sets_a_flag() as pressed:   # from Enter to the answer's end: Ctrl-C stops the answer
                ids = chat_ids(llm, messages, args, earlier_turns=len(history) > len(system))
                result = stream_to_stdout(llm, ids, kwargs, stop_requested=pressed)
        except OutputError:        # stdout is gone: nothing more can be shown
            raise
        except NpqwenError as e:   # e.g. the conversation outgrew the context: say so and keep going
            print(f"npqwen: error: {e}", file=sys.stderr)
            continue
        if result is None:
            # A stopped answer is dropped: the next turn reads as if the question had not been answered,
            # rather than as an answer that ends mid-sentence.
            print("(answer stopped; it is not kept in the history; Ctrl-C again or /exit quits)", file=sys.stderr)
            continue
        # Qwen3 keeps only the final answer of earlier turns, not their reasoning.
        history = messages + [{"role": "assistant", "content": split_reasoning(result.text)[1]}]
        print_stats(result)
        if len(ids) + len(result.token_ids) >= llm.config.max_position_embeddings:
            print(f"(the conversation fills the context of {llm.config.max_position_embeddings} tokens, so the "
                  f"answer was cut; /reset clears the history)", file=sys.stderr)


def chat_ids(llm, messages, args, earlier_turns: bool) -> list[int]:
    """The conversation under the chat template, as token ids; one that leaves no room to answer is refused
    with a message that names the history, which is what grew."""
    ids = llm.tokenizer.encode(llm.chat_prompt(messages, enable_thinking=not args.no_think))
    context = llm.config.max_position_embeddings
    if len(ids) >= context and earlier_turns:
        raise NpqwenError(f"the conversation has outgrown the context: the history and this message are {len(ids)} "
                          f"tokens, the model holds {context}; /reset clears the history")
    if len(ids) >= context:
        raise NpqwenError(f"this message is {len(ids)} tokens under the chat template, the model holds {context}; "
                          f"send a shorter one")
    return ids


def line_editing():
    """Arrow keys edit the line and recall earlier lines: importing readline is enough for input() to use it."""
    try:
        import readline  # noqa: F401
    except ImportError:   # e.g. Windows without pyreadline: plain input() still works
        pass


def print_stats(result, load_seconds: float | None = None):
    lines = []
    if load_seconds is not None:
        lines.append(f"load: {load_seconds:.2f} s")
    lines.append(f"prompt: {result.prompt_tokens} tokens, {result.prompt_tokens_per_second:.1f} tokens/s")
    lines.append(f"generation: {len(result.token_ids)} tokens, {result.generation_tokens_per_second:.1f} "
                 f"tokens/s ({result.finish_reason})")
    lines.append(f"peak memory: {peak_rss_bytes() / 1e9:.3f} GB")
    print("==========\n" + "\n".join(lines), file=sys.stderr)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def prompt_ids(llm, args, prompt: str) -> list[int]:
    if args.chat:
        prompt = llm.chat_prompt(prompt)
    ids = llm.tokenizer.encode(prompt)   # load_model refused a checkpoint without a tokenizer
    if not ids:
        raise NpqwenError("the prompt is empty")
    return ids


def cmd_serve(args) -> int:
    """Load, make the engine, bind the port, and serve until Ctrl-C (uvicorn stops cleanly on SIGINT)."""
    import socket

    try:
        import uvicorn

        from .server.app import create_app
    except ImportError as e:
        raise NpqwenError(f"npqwen serve needs the serve extra: pip install 'npqwen[serve]' ({e.name} is "
                          f"missing)") from None
    from .engine import Engine

    if not 0 <= args.port <= 65535:
        raise NpqwenError(f"--port must be in 0 .. 65535, got {args.port}")
    if args.max_queue < 1:
        raise NpqwenError(f"--max-queue must be >= 1, got {args.max_queue}")
    try:   # bound before the (slow) load, so that a port in use is said at once
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(2048)   # clients that come before uvicorn takes the socket wait in the backlog
    except OSError as e:
        raise NpqwenError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); pick another --port "
                          f"(0 picks a free one) or --host") from None
    llm, seconds = load_model(args, chat_template=True)
    engine = Engine(llm, **engine_sizes(args))
    name = args.served_model_name or args.model
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def ready():
        print(f"npqwen: serving {name} at {url}/v1, the web page at {url}/ (loaded in {seconds:.1f} s; KV cache "
              f"{engine.pool.num_pages * engine.page_size} positions); Ctrl-C stops", flush=True)

    app = create_app(llm, engine, name, api_key=args.api_key, max_queue=args.max_queue, on_ready=ready)
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
    server.run(sockets=[sock])
    print("npqwen: stopped", flush=True)
    return 0


def cmd_inspect(args) -> int:
    from .describe import describe

    check_device_dtype(args)
    write_out(describe(args.model, device=args.device, dtype=args.dtype) + "\n")
    return 0


def cmd_trace(args) -> int:
    from .trace import Trace, npz_name, parse_layers, plot_attention, pyplot

    check_device_dtype(args)
    prompt = checked_text(args.prompt, "prompt")
    # Everything that can be known to fail, before the (slow) load and forward pass.
    save = npz_name(args.save) if args.save else None   # np.savez adds ".npz": check and report the real name
    if save:
        check_writable(save, "--save")
    if args.plot_attention:
        if args.layer is None:
            raise NpqwenError("--plot-attention needs --layer N (the layer to draw)")
        check_writable(args.plot_attention, "--plot-attention")
        pyplot()   # matplotlib is there
    llm, _ = load_model(args, chat_template=args.chat)
    L = llm.config.num_hidden_layers
    layers = parse_layers(args.layers, L) if args.layers else None
    if args.plot_attention:
        if not 0 <= args.layer < L:
            raise NpqwenError(f"--plot-attention needs --layer between 0 and {L - 1}")
        if args.head is not None and not 0 <= args.head < llm.config.num_attention_heads:
            raise NpqwenError(f"--head must be between 0 and {llm.config.num_attention_heads - 1}")
    ids = prompt_ids(llm, args, prompt)
    trace = Trace(None if layers is None else set(layers) | ({args.layer} if args.plot_attention else set()))
    llm.forward(ids, recorder=trace)
    tokens = [llm.tokenizer.decode([i]) for i in ids]
    write_out(f"{len(ids)} tokens: " + " ".join(f"{i}:{t!r}" for i, t in zip(ids, tokens)) + "\n")
    shown = Trace(layers)
    for name, array in trace.items():
        shown(name, array)
    write_out(shown.table() + "\n")
    if save:
        try:
            shown.save(save)
        except OSError as e:
            raise NpqwenError(f"{save}: cannot write it ({e.strerror or e})") from None
        print(f"saved {len(shown)} arrays to {save}", file=sys.stderr)
    if args.plot_attention:
        probs = trace[f"model.layers.{args.layer}.self_attn.attn_probs"]            # (H, T, T)
        picture = probs[args.head] if args.head is not None else probs.mean(axis=0)
        which = f"head {args.head}" if args.head is not None else f"mean of {probs.shape[0]} heads"
        try:
            plot_attention(picture, tokens, args.plot_attention, f"layer {args.layer}, {which}")
        except (OSError, ValueError) as e:   # matplotlib: ValueError for an unknown extension such as .xyz
            raise NpqwenError(f"{args.plot_attention}: cannot draw it ({e})") from None
        print(f"attention of layer {args.layer} ({which}) drawn in {args.plot_attention}", file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    from .compare import compare, report, require_torch

    check_device_dtype(args)
    prompt = checked_text(args.prompt, "prompt")
    require_torch()   # before the load, not after it
    llm, _ = load_model(args, chat_template=args.chat)
    rows = compare(llm, prompt_ids(llm, args, prompt), tol=args.tol)
    write_out(report(rows, args.tol) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1
