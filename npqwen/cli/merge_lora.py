"""`npqwen merge-lora BASE ADAPTER OUT`: a checkpoint whose weights are W + scale * B A (PEFT's merge_and_unload)."""
from ..errors import NpqwenError
from .common import check_checkpoint, check_writable


def add_parser(commands):
    p = commands.add_parser("merge-lora", help="fold a PEFT LoRA adapter into its base: a new checkpoint",
                            description="Write BASE with ADAPTER merged into its weights (W + scale * B A, as PEFT's "
                                        "merge_and_unload) to the directory OUT, with BASE's tokenizer and "
                                        "generation defaults; it then runs like any checkpoint, at no cost per token.")
    p.add_argument("base", metavar="BASE", help="the base checkpoint directory or hub id (required, no default)")
    p.add_argument("adapter", metavar="ADAPTER", help="the PEFT adapter directory (required, no default)")
    p.add_argument("out", metavar="OUT", help="the directory to write, made if missing (required, no default)")
    p.add_argument("--save-dtype", default="F32", choices=["F32", "BF16", "F16"],
                   help="the dtype of the written weights (default: F32)")
    p.set_defaults(run=cmd_merge_lora)


def cmd_merge_lora(args) -> int:
    from pathlib import Path

    from .. import load
    from ..hub import resolve_model
    from ..lora import merge

    base = resolve_model(args.base)
    check_checkpoint(base, tokenizer=False)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NpqwenError(f"{out}: cannot make the directory ({e.strerror or e})") from None
    check_writable(str(out / "model.safetensors"), "OUT")
    llm = load(base, lora={"merged": args.adapter}, weights="float32")   # merged into float32, whatever is stored
    merge(llm.model.weights, llm.lora_adapter("merged"))
    llm.save(out, dtype=args.save_dtype)
    print(f"npqwen: wrote {out} ({base.name} + {Path(args.adapter).name})")
    return 0
