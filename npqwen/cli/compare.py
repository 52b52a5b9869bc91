"""`npqwen compare`: every traced step of one forward pass against HF transformers' (npqwen/compare.py)."""
from .common import (check_device_dtype, checked_text, load_model, model_options, one_prompt_options, prompt_ids,
                     write_out)


def add_parser(commands):
    p = commands.add_parser("compare", parents=[model_options(), one_prompt_options()],
                            help="module-by-module difference from HF transformers (needs torch)")
    p.add_argument("--tol", type=float, default=1e-3,
                   help="tolerance, relative to max |HF| (at least 1) (default: 0.001)")
    p.set_defaults(run=cmd_compare)


def cmd_compare(args) -> int:
    from ..compare import compare, report, require_torch

    check_device_dtype(args)
    prompt = checked_text(args.prompt, "prompt")
    require_torch()   # before the load, not after it
    llm, _ = load_model(args, chat_template=args.chat)
    rows = compare(llm, prompt_ids(llm, args, prompt), tol=args.tol)
    write_out(report(rows, args.tol) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1
