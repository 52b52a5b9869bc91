"""The `npqwen` command: generate, chat (and bench, inspect, trace, compare).

A mistake the user can fix (bad path, bad value, prompt too long) prints one line on stderr
and exits with status 1, without a traceback.
"""
import argparse
import codecs
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import NpqwenError
from .hub import DEFAULT_MODEL


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except NpqwenError as e:
        print(f"npqwen: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:   # e.g. `npqwen generate ... | head`
        sys.stderr.close()
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="npqwen", description="Qwen3 inference in plain NumPy / CuPy.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"npqwen {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", "-m", default=DEFAULT_MODEL,
                       help=f"checkpoint directory, or hub id in the HF cache (default {DEFAULT_MODEL})")
    model.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    model.add_argument("--dtype", default="float32", help="compute dtype (cpu: float32, float64; cuda: also float16)")

    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-new-tokens", "-n", type=int, default=512)
    sampling.add_argument("--temperature", "-t", type=float, help="0 is greedy (default: generation_config.json)")
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--repetition-penalty", type=float)
    sampling.add_argument("--presence-penalty", type=float)
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    sampling.add_argument("--no-think", action="store_true", help="enable_thinking=False in the chat template")
    sampling.add_argument("--system", help="system message")

    p = commands.add_parser("generate", parents=[model, sampling],
                            help="complete one prompt, streaming; or a file of prompts, batched")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", "-p", help="the prompt ('-' reads it from stdin)")
    source.add_argument("--prompts-file", metavar="FILE",
                        help="many prompts, run together through one engine: one per line, or JSONL lines with "
                             "\"prompt\" or \"messages\" and optional sampling fields ('-' reads stdin)")
    p.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    batch = p.add_argument_group("with --prompts-file")
    batch.add_argument("--output", "-o", metavar="OUT.jsonl", help="write the results here (default: stdout)")
    batch.add_argument("--max-batch-size", type=int, help="most requests in one step (default: the engine's)")
    batch.add_argument("--max-batched-tokens", type=int, help="most tokens in one step (default: the engine's)")
    batch.add_argument("--kv-cache-tokens", type=int,
                       help="KV-cache positions (default: the engine's, a share of free memory)")
    batch.add_argument("--page-size", type=int, help="positions per KV-cache page (default: the engine's)")
    p.set_defaults(run=cmd_generate)

    p = commands.add_parser("chat", parents=[model, sampling], help="interactive multi-turn chat")
    p.set_defaults(run=cmd_chat)

    p = commands.add_parser("inspect", parents=[model], help="the config and every weight, with parameter counts")
    p.set_defaults(run=cmd_inspect)

    one_pass = argparse.ArgumentParser(add_help=False)
    one_pass.add_argument("--prompt", "-p", required=True)
    one_pass.add_argument("--chat", action="store_true", help="apply the chat template to the prompt first")

    p = commands.add_parser("trace", parents=[model, one_pass],
                            help="one forward pass: every step's shape, dtype and statistics")
    p.add_argument("--layers", help="only these layers, e.g. 0,3,5-7")
    p.add_argument("--save", metavar="FILE.npz", help="keep every intermediate array, under its name")
    p.add_argument("--plot-attention", metavar="FILE.png", help="heatmap of one layer's attention probabilities")
    p.add_argument("--layer", type=int, help="the layer to plot")
    p.add_argument("--head", type=int, help="the head to plot (default: the mean over heads)")
    p.set_defaults(run=cmd_trace)

    p = commands.add_parser("compare", parents=[model, one_pass],
                            help="module-by-module difference from HF transformers (needs torch)")
    p.add_argument("--tol", type=float, default=1e-3, help="tolerance, relative to max |HF| (at least 1)")
    p.set_defaults(run=cmd_compare)
    return parser


def load_model(args):
    from . import load

    started = time.perf_counter()
    llm = load(args.model, device=args.device, dtype=args.dtype)
    return llm, time.perf_counter() - started


def sampling_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, seed=args.seed, stop=args.stop)


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
    if given:
        raise NpqwenError(f"{given[0]} goes with --prompts-file, not --prompt")
    if args.prompt == "-":
        try:
            args.prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise NpqwenError(f"the prompt on stdin is not valid UTF-8 ({e})") from None
    prompt = checked_text(args.prompt, "prompt")
    llm, load_seconds = load_model(args)
    kwargs = sampling_kwargs(args)   # checked before the (slow) generation starts
    if not args.raw:
        messages = system_messages(args) + [{"role": "user", "content": prompt}]
        prompt = llm.chat_prompt(messages, enable_thinking=not args.no_think)
    print_stats(stream_to_stdout(llm, prompt, kwargs), load_seconds)
    return 0


def system_messages(args) -> list[dict]:
    return [{"role": "system", "content": checked_text(args.system, "system message")}] if args.system else []


def stream_to_stdout(llm, prompt, kwargs):
    """Generate, writing each text piece as it comes; the GenerationResult at the end."""
    from .generate import GenerationResult

    result = GenerationResult("", [], "length")
    for piece in llm.stream(prompt, result=result, **kwargs):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return result


SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "seed", "stop")
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
    from .generate import check_request
    from .sampling import sampling_params

    name = file_name(args.prompts_file)
    prompts = read_prompts_file(args.prompts_file)   # the file's own mistakes show before the (slow) load
    llm, load_seconds = load_model(args)
    engine = Engine(llm, **{k: getattr(args, k) for k in ENGINE_SIZES if getattr(args, k) is not None})
    defaults = sampling_kwargs(args)
    # The command line's values alone (with a one-token stand-in prompt), so a bad one is not blamed on line 1.
    check_request(llm.config, [0], defaults["max_new_tokens"], defaults["stop"])
    sampling_params(llm.generation_defaults,
                    **{k: v for k, v in defaults.items() if k not in ("max_new_tokens", "stop")})
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
                out.write(json.dumps(result_record(written, prompts[written], results[written]),
                                     ensure_ascii=False) + "\n")
                written += 1
            out.flush()
            progress.show()
        progress.show(final=True)
    finally:
        if out is not sys.stdout:
            out.close()
    print_batch_stats(list(results.values()), progress.elapsed(), engine.stats, load_seconds)
    if args.output:
        print(f"wrote {written} results to {args.output}", file=sys.stderr)
    return 0


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

    llm, _ = load_model(args)
    kwargs = sampling_kwargs(args)
    system = system_messages(args)
    history = list(system)
    print(f"npqwen chat with {args.model}. /reset clears the history, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except UnicodeDecodeError:
            print("npqwen: error: that input is not valid UTF-8; try again", file=sys.stderr)
            continue
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
            result = stream_to_stdout(llm, llm.chat_prompt(messages, enable_thinking=not args.no_think), kwargs)
        except NpqwenError as e:   # e.g. the conversation outgrew the context: say so and keep going
            print(f"npqwen: error: {e}", file=sys.stderr)
            continue
        # Qwen3 keeps only the final answer of earlier turns, not their reasoning.
        history = messages + [{"role": "assistant", "content": split_reasoning(result.text)[1]}]
        print_stats(result)


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


def prompt_ids(llm, args) -> list[int]:
    prompt = checked_text(args.prompt, "prompt")
    if args.chat:
        prompt = llm.chat_prompt(prompt)
    if llm.tokenizer is None:
        raise NpqwenError(f"{llm.path}: no tokenizer.json, so the prompt cannot be tokenized")
    ids = llm.tokenizer.encode(prompt)
    if not ids:
        raise NpqwenError("the prompt is empty")
    return ids


def cmd_inspect(args) -> int:
    from .describe import describe

    print(describe(args.model, device=args.device, dtype=args.dtype))
    return 0


def cmd_trace(args) -> int:
    from .trace import Trace, parse_layers, plot_attention

    llm, _ = load_model(args)
    L = llm.config.num_hidden_layers
    layers = parse_layers(args.layers, L) if args.layers else None
    if args.plot_attention:
        if args.layer is None or not 0 <= args.layer < L:
            raise NpqwenError(f"--plot-attention needs --layer between 0 and {L - 1}")
        if args.head is not None and not 0 <= args.head < llm.config.num_attention_heads:
            raise NpqwenError(f"--head must be between 0 and {llm.config.num_attention_heads - 1}")
    ids = prompt_ids(llm, args)
    trace = Trace(None if layers is None else set(layers) | ({args.layer} if args.plot_attention else set()))
    llm.forward(ids, recorder=trace)
    tokens = [llm.tokenizer.decode([i]) for i in ids]
    print(f"{len(ids)} tokens: " + " ".join(f"{i}:{t!r}" for i, t in zip(ids, tokens)))
    shown = Trace(layers)
    for name, array in trace.items():
        shown(name, array)
    print(shown.table())
    if args.save:
        shown.save(args.save)
        print(f"saved {len(shown)} arrays to {args.save}", file=sys.stderr)
    if args.plot_attention:
        probs = trace[f"model.layers.{args.layer}.self_attn.attn_probs"]            # (H, T, T)
        picture = probs[args.head] if args.head is not None else probs.mean(axis=0)
        which = f"head {args.head}" if args.head is not None else f"mean of {probs.shape[0]} heads"
        plot_attention(picture, tokens, args.plot_attention, f"layer {args.layer}, {which}")
        print(f"attention of layer {args.layer} ({which}) drawn in {args.plot_attention}", file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    from .compare import compare, report

    llm, _ = load_model(args)
    rows = compare(llm, prompt_ids(llm, args), tol=args.tol)
    print(report(rows, args.tol))
    return 0 if all(r["ok"] for r in rows) else 1
