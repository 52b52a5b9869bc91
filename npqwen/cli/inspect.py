"""`npqwen inspect`: the config and every weight of a checkpoint, with parameter counts (no load)."""
from ..hub import resolve_model
from .common import check_checkpoint, check_device_dtype, model_options, write_out


def add_parser(commands):
    p = commands.add_parser("inspect", parents=[model_options()],
                            help="the config and every weight, with parameter counts")
    p.set_defaults(run=cmd_inspect)


def cmd_inspect(args) -> int:
    from ..describe import describe
    from ..tiny import BUILTIN

    check_device_dtype(args)
    if args.model not in BUILTIN:
        check_checkpoint(resolve_model(args.model), tokenizer=False)
    write_out(describe(args.model, device=args.device, dtype=args.dtype) + "\n")
    return 0


