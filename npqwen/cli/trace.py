"""`npqwen trace`: one forward pass with every step's shape, dtype and statistics (npqwen/trace.py);
optionally every array saved, and one layer's attention drawn."""
import sys

from ..errors import NpqwenError
from .common import (check_device_dtype, check_writable, checked_text, load_model, model_options,
                     one_prompt_options, prompt_ids, write_out)


def add_parser(commands):
    p = commands.add_parser("trace", parents=[model_options(), one_prompt_options()],
                            help="one forward pass: every step's shape, dtype and statistics")
    p.add_argument("--layers", help="only these layers, e.g. 0,3,5-7 (default: all)")
    p.add_argument("--save", metavar="FILE.npz",
                   help="keep every intermediate array, under its name; .npz is added if missing (default: none)")
    p.add_argument("--plot-attention", metavar="FILE.png",
                   help="heatmap of one layer's attention probabilities (default: none)")
    p.add_argument("--layer", type=int, help="the layer to plot (required with --plot-attention; the table's layers "
                                             "are --layers)")
    p.add_argument("--head", type=int, help="the head to plot (default: the mean over heads)")
    p.set_defaults(run=cmd_trace)


def cmd_trace(args) -> int:
    from ..trace import Trace, npz_name, parse_layers, plot_attention, pyplot

    check_device_dtype(args)
    prompt = checked_text(args.prompt, "prompt")
    # Everything that can be known to fail, before the (slow) load and forward pass.
    save = npz_name(args.save) if args.save else None   # np.savez adds ".npz": check and report the real name
    if save:
        check_writable(save, "--save")
    # --layers picks the layers the table shows; --layer and --head what --plot-attention draws: each error names the other
    if not args.plot_attention:
        given = [o for o, value in (("--layer", args.layer), ("--head", args.head)) if value is not None]
        if given:
            raise NpqwenError(f"{given[0]} goes with --plot-attention (the layer and head it draws); to trace only "
                              f"some layers, use --layers (e.g. --layers 0,3)")
    if args.plot_attention:
        if args.layer is None:
            raise NpqwenError("--plot-attention needs --layer N, the layer to draw (--layers only chooses the "
                              "layers the table shows)")
        check_writable(args.plot_attention, "--plot-attention")
        pyplot()   # matplotlib is there
    llm, _ = load_model(args, chat_template=args.chat)
    L = llm.config.num_hidden_layers
    layers = parse_layers(args.layers, L) if args.layers else None
    if args.plot_attention:
        if not 0 <= args.layer < L:
            raise NpqwenError(f"--plot-attention needs --layer between 0 and {L - 1}")
        if llm.config.is_linear_layer(args.layer):   # Qwen3.5 / Qwen3-Next: a state matrix, no weights to draw
            full = [i for i in range(L) if not llm.config.is_linear_layer(i)]
            raise NpqwenError(f"layer {args.layer} is a Gated DeltaNet linear-attention layer: it reads a fixed-size "
                              f"state, not the positions, so it has no attention weights to draw; choose a "
                              f"full-attention layer: {full}")
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
    write_out(expert_loads(shown, llm.config.num_experts))
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


def expert_loads(trace, num_experts: int) -> str:
    """Qwen3-MoE: how many of the tokens' choices each expert got, per sparse layer (nothing for a dense model)."""
    from ..moe import expert_load

    lines = [f"{name.removesuffix('.top_k_index')}: tokens per expert {expert_load(chosen, num_experts).tolist()}\n"
             for name, chosen in trace.items() if name.endswith(".mlp.gate.top_k_index")]
    return "".join(lines)
