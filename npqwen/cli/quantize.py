"""`npqwen quantize IN OUT --to FORMAT`: a checkpoint whose weight matrices are stored compact (docs/weights.md)."""
from ..errors import NpqwenError
from .common import check_checkpoint, check_writable

TARGETS = ["int8", "q8_0", "q4_0", "q4_k", "bfloat16", "float16"]


def add_parser(commands):
    p = commands.add_parser("quantize", help="store a checkpoint's weights as int8, Q8_0, Q4_0, Q4_K or bfloat16",
                            description="Write IN to the directory OUT with its linear layers' matrices and its "
                                        "embedding in FORMAT (norms and routers stay float32), with IN's tokenizer "
                                        "and generation defaults. npqwen loads OUT as stored, a few rows widened at "
                                        "a time (docs/weights.md says how each format is laid out in the file).")
    p.add_argument("model_in", metavar="IN", help="the checkpoint directory or hub id (required, no default)")
    p.add_argument("out", metavar="OUT", help="the directory to write, made if missing (required, no default)")
    p.add_argument("--to", required=True, choices=TARGETS, metavar="FORMAT",
                   help=f"the format: {', '.join(TARGETS)} (required, no default)")
    p.set_defaults(run=cmd_quantize)


def cmd_quantize(args) -> int:
    import json
    import shutil
    from pathlib import Path

    from .. import load
    from ..checkpoint import save_compact
    from ..config import Qwen3Config
    from ..hub import resolve_model
    from ..weights import total_bytes

    source = resolve_model(args.model_in)
    check_checkpoint(source, tokenizer=False)
    out = Path(args.out)
    if out.resolve() == Path(source).resolve():
        raise NpqwenError(f"OUT is IN ({out}); write the quantized checkpoint to another directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NpqwenError(f"{out}: cannot make the directory ({e.strerror or e})") from None
    check_writable(str(out / "model.safetensors"), "OUT")
    if Qwen3Config.from_json(Path(source) / "config.json").fused_experts:   # Qwen3-VL-MoE's two tensors per layer
        raise NpqwenError(f"{source}: npqwen quantize does not write Qwen3-VL-MoE's stacked expert tensors "
                          f"(mlp.experts.gate_up_proj) yet; load the checkpoint with --weights {args.to} instead, "
                          f"which converts them while loading")
    llm = load(source, weights=args.to)   # converted a few rows at a time: no float32 copy of the model
    weights = {name: w for name, w in llm.weights.items()
               if not (name == "lm_head.weight" and llm.config.tie_word_embeddings)}
    save_compact(out / "model.safetensors", weights)
    config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = {"quant_method": "npqwen", "weights": args.to}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in Path(source).iterdir():   # tokenizer, chat template, generation defaults, embedding files
        if f.is_file() and f.name not in ("config.json", "model.safetensors.index.json") \
                and not f.name.endswith(".safetensors") and f.stat().st_size < 64 * 2**20:
            shutil.copy(f, out / f.name)
        elif f.is_dir() and not f.name.startswith("."):   # sentence-transformers' 1_Pooling/
            shutil.copytree(f, out / f.name, dirs_exist_ok=True)
    print(f"npqwen: wrote {out} ({Path(source).name} with its matrices as {args.to}: "
          f"{total_bytes(llm.model.weights):,} bytes of weights)")
    return 0
