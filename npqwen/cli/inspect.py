"""`npqwen inspect`: the config and every weight of a checkpoint, with parameter counts (no load)."""
from .common import check_device_dtype, model_options, write_out


def add_parser(commands):
    p = commands.add_parser("inspect", parents=[model_options()],
                            help="the config and every weight, with parameter counts")
    p.set_defaults(run=cmd_inspect)


def cmd_inspect(args) -> int:
    from ..describe import describe

    check_device_dtype(args)
    write_out(describe(args.model, device=args.device, dtype=args.dtype) + "\n")
    return 0


