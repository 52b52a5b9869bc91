"""The `npqwen` command: generate, chat (and bench, inspect, trace, compare).

A mistake the user can fix (bad path, bad value, prompt too long) prints one line on stderr
and exits with status 1, without a traceback.
"""
import argparse
import resource
import sys
import time

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

    p = commands.add_parser("generate", parents=[model, sampling], help="complete one prompt, streaming")
    p.add_argument("--prompt", "-p", required=True, help="the prompt ('-' reads it from stdin)")
    p.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
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
