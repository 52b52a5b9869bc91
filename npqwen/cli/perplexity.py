"""`npqwen perplexity`: how well the model predicts a text file, exp(-mean log p of each token).

A text longer than the window is read in overlapping windows (Hugging Face's sliding-window
recipe): each window starts `stride` tokens after the last one began, and scores only the tokens
the windows before it did not, so every token but the first is scored once, with up to
window - stride tokens of context before it. The windows run together through the engine
(llm.score), each a prompt whose logprobs are read chunk by chunk.
"""
import math
import sys
import time

from ..errors import NpqwenError
from .common import input_name, load_model, model_options, read_input_file, write_out

DEFAULT_WINDOW = 2048   # tokens a window holds (lm-evaluation-harness's default max_length)


def add_parser(commands):
    p = commands.add_parser("perplexity", parents=[model_options()], help="the model's perplexity on a text file",
                            description="exp(-mean log p) of every token of a text file after the first, the "
                                        "text read as it is (no chat template), in overlapping windows when it "
                                        "is longer than one.")
    p.add_argument("--input", "-i", required=True, metavar="FILE", help="the text, UTF-8 ('-' reads stdin)")
    p.add_argument("--window", type=int, help=f"tokens a window holds (default: {DEFAULT_WINDOW}, or the "
                                              f"model's context less one if that is smaller)")
    p.add_argument("--stride", type=int, help="tokens from one window's start to the next's (default: half the "
                                              "window)")
    p.set_defaults(run=cmd_perplexity)


def cmd_perplexity(args) -> int:
    for name in ("window", "stride"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "window" else 1):
            raise NpqwenError(f"--{name} must be at least {2 if name == 'window' else 1}, got {value}")
    text = read_input_file(args.input)   # before the (slow) load
    llm, load_seconds = load_model(args)
    context = llm.config.max_position_embeddings - 1   # a window is a prompt, with room for the token it draws
    window = min(args.window or DEFAULT_WINDOW, context)
    if args.window is not None and args.window > context:
        raise NpqwenError(f"--window {args.window} is more than the model's context allows ({context})")
    stride = args.stride or max(1, window // 2)
    if stride >= window:   # each window's first token needs a token before it, in the same window
        raise NpqwenError(f"--stride {stride} must be less than the window ({window}): the windows overlap, so "
                          f"that the first token each one scores has tokens before it")
    ids = llm.tokenizer.encode(text)
    if len(ids) < 2:
        raise NpqwenError(f"{input_name(args.input)} has {plural(len(ids), 'token')}: a perplexity "
                          f"needs at least two (the first token has nothing before it to be predicted from)")
    started = time.perf_counter()
    windows, news = sliding_windows(len(ids), window, stride)
    scores = llm.score([ids[a:b] for a, b in windows])
    logprobs = [lp for s, n in zip(scores, news) for lp in s.logprobs[len(s.logprobs) - n:]]
    seconds = time.perf_counter() - started
    assert len(logprobs) == len(ids) - 1
    mean = sum(logprobs) / len(logprobs)
    scored = plural(len(logprobs), "token")   # one count on both streams: the tokens predicted
    write_out(f"perplexity {math.exp(-mean):.4f} (mean log p {mean:.4f}) over {scored} of "
              f"{input_name(args.input)}; {plural(len(windows), 'window')} of up to {window} tokens, "
              f"stride {stride}\n")
    print(f"load: {load_seconds:.2f} s; scored {scored} in {seconds:.2f} s "
          f"({len(logprobs) / seconds:.1f} tokens/s)", file=sys.stderr)
    return 0


def plural(n: int, word: str) -> str:
    """'1 token', '2 tokens'."""
    return f"{n} {word}{'s' * (n != 1)}"


def sliding_windows(total: int, window: int, stride: int) -> tuple[list[tuple[int, int]], list[int]]:
    """([start, end) of each window over `total` tokens, how many of each window's last tokens it
    scores: those no window before it scored; the first window scores all but its first token)."""
    windows, news, scored_to = [], [], 1   # tokens 0 .. scored_to - 1 are done (token 0 is never scored)
    for start in range(0, total, stride):
        end = min(start + window, total)
        windows.append((start, end))
        news.append(end - scored_to)
        scored_to = end
        if end == total:
            break
    return windows, news


