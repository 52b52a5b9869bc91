"""`npqwen lens`: the logit lens (npqwen/lens.py) as a table, layers by positions, of each lens's top token
and its probability; optionally drawn as a heatmap."""
import sys
import unicodedata

from ..errors import NpqwenError
from .common import (check_device_dtype, check_writable, checked_text, load_model, model_options,
                     one_prompt_options, prompt_ids, write_out)


def add_parser(commands):
    p = commands.add_parser("lens", parents=[model_options(), one_prompt_options()],
                            help="the logit lens: each layer's top next token at each position")
    p.add_argument("--top-k", type=int, default=1, help="tokens shown per cell (default: 1)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the table as a heatmap of the top probability "
                                                      "(default: none)")
    p.set_defaults(run=cmd_lens)


def cmd_lens(args) -> int:
    from ..trace import pyplot

    check_device_dtype(args)
    prompt = checked_text(args.prompt, "prompt")
    if args.top_k < 1:
        raise NpqwenError(f"--top-k must be at least 1, got {args.top_k}")
    if args.plot:
        check_writable(args.plot, "--plot")
        pyplot()   # matplotlib is there
    llm, _ = load_model(args, chat_template=args.chat)
    ids = prompt_ids(llm, args, prompt)
    lens = llm.logit_lens(ids, top_k=args.top_k)
    show = lambda i: token_text(llm.tokenizer.decode([int(i)]))   # noqa: E731  a cell's text
    write_out(lens_table(lens, show))
    if args.plot:
        try:
            plot_lens(lens, show, args.plot)
        except (OSError, ValueError) as e:
            raise NpqwenError(f"{args.plot}: cannot draw it ({e})") from None
        print(f"the lens of {lens.top_ids.shape[0]} layers drawn in {args.plot}", file=sys.stderr)
    return 0


def token_text(text: str, most: int = 10) -> str:
    """A token's text for a cell: what does not print escaped as repr writes it (\\n, \\x1b), a space as
    \u2423, cut to `most` columns of a terminal."""
    text = repr(text)[1:-1].replace(" ", "\u2423")
    while columns(text) > most:
        text = text[:-1]
    return text


def columns(text: str) -> int:
    """How many columns of a terminal `text` takes: two for a wide East Asian character (CJK, most emoji),
    none for a combining mark, one for the rest."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
               for c in text)


def lens_table(lens, show) -> str:
    """Rows: layers (the last is the model's own output); columns: the prompt's positions; cells: top token p.
    Padded by terminal columns, not characters, so that a row of CJK tokens keeps the columns."""
    L, T, k = lens.top_ids.shape
    cells = [[" ".join(f"{show(lens.top_ids[i, t, j])} {lens.top_probs[i, t, j]:.2f}" for j in range(k))
              for t in range(T)] for i in range(L)]
    head = [show(i) for i in lens.token_ids]
    width = [max(columns(head[t]), *(columns(cells[i][t]) for i in range(L))) for t in range(T)]
    pad = lambda text, w: text + " " * (w - columns(text))   # noqa: E731
    lines = ["layer  " + "  ".join(pad(h, w) for h, w in zip(head, width))]
    lines += [f"{i:>5}  " + "  ".join(pad(c, w) for c, w in zip(cells[i], width)) for i in range(L)]
    return "\n".join(lines) + "\n"


def plot_lens(lens, show, path):
    """A heatmap, layers by positions, of each lens's top probability, each cell labelled with its token."""
    from ..trace import drawable, pyplot

    plt = pyplot()
    L, T, _ = lens.top_ids.shape
    fig, ax = plt.subplots(figsize=(min(3 + 1.1 * T, 40), min(2 + 0.4 * L, 30)))
    image = ax.imshow(lens.top_probs[:, :, 0], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    for i in range(L):   # parse_math=False: a token such as "$x$" is text, not TeX
        for t in range(T):
            ax.text(t, i, drawable(show(lens.top_ids[i, t, 0])), ha="center", va="center", fontsize=7, color="white",
                    parse_math=False)
    ax.set_xticks(range(T), [drawable(show(i)) for i in lens.token_ids], rotation=90, fontsize=8, parse_math=False)
    ax.set_xlabel("position (its token)")
    ax.set_ylabel("layer")
    ax.set_title("logit lens: each layer's top next token")
    fig.colorbar(image, ax=ax, label="probability")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
