"""`npqwen finetune --model M --data FILE.jsonl --lora-r 16 --out DIR`: a LoRA adapter trained without torch."""
from ..errors import NpqwenError
from .common import model_options


def add_parser(commands):
    p = commands.add_parser("finetune", parents=[model_options()],
                            help="train a LoRA adapter on a JSONL file, without torch (PEFT's files in OUT)",
                            description="Train a LoRA adapter (AdamW, the loss on the answer tokens only) and write "
                                        "it in PEFT's format to --out, which PEFT loads and npqwen serves (--lora). "
                                        "A line of --data is {\"prompt\": ..., \"completion\": ...} or {\"messages\": "
                                        "[...]} ending with the assistant's answer. Rerun with the same --out to "
                                        "resume from its latest checkpoint.")
    p.add_argument("--data", required=True, help="the JSONL file of examples (required, no default)")
    p.add_argument("--out", required=True, help="the directory for the adapter and checkpoints (required, no default)")
    p.add_argument("--lora-r", type=int, default=16, help="the adapter's rank (default: 16)")
    p.add_argument("--lora-alpha", type=float, default=32, help="scale = alpha / r (default: 32)")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="the projections to adapt, comma-separated, as PEFT's target_modules: q_proj,k_proj,v_proj,"
                        "o_proj,gate_proj,up_proj,down_proj for all seven (default: PEFT's default for the model type, "
                        "q_proj,v_proj on Qwen3; all seven where PEFT has none: Qwen3-MoE, Qwen3.5, Qwen4-Exp)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: one pass over the data)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate (default: 1e-4)")
    p.add_argument("--accumulate", type=int, default=1, help="examples per optimizer step (default: 1)")
    p.add_argument("--save-every", type=int, default=0, help="a checkpoint every N steps (default: 0, none)")
    p.add_argument("--max-tokens", type=int, default=None, help="cut or refuse longer examples (default: the "
                                                                "model's context)")
    p.add_argument("--too-long", choices=["cut", "refuse"], default="cut",
                   help="what to do with an example over --max-tokens (default: cut)")
    p.add_argument("--seed", type=int, default=0, help="the adapter's initial values (default: 0)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="keep only each layer's input going forward and recompute the layer before its backward: "
                        "less memory for one more forward's work (default: off)")
    p.set_defaults(run=cmd_finetune)


def cmd_finetune(args) -> int:
    import time

    from tqdm import tqdm

    from .. import load
    from ..finetune import finetune, read_examples

    for name in ("lora_r", "accumulate", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise NpqwenError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.lr <= 0:
        raise NpqwenError(f"--lr must be positive, got {args.lr}")
    llm = load(args.model, device=args.device, dtype=args.dtype, weights=args.weights)   # int8/bfloat16: QLoRA's way
    if llm.tokenizer is None:
        raise NpqwenError(f"{args.model}: no tokenizer files; finetune reads text")
    examples = read_examples(args.data, llm.tokenizer, args.max_tokens or llm.config.max_position_embeddings,
                             args.too_long)
    steps = args.steps or -(-len(examples) // args.accumulate)
    bar, start, tokens = tqdm(total=steps, unit="step", dynamic_ncols=True), time.perf_counter(), [0]

    def progress(step, loss, n):
        tokens[0] += n
        bar.n = step
        bar.set_postfix_str(f"loss {loss:.4f}, {tokens[0] / (time.perf_counter() - start):.0f} tokens/s")

    try:
        losses = finetune(llm.model, examples, args.out, steps, args.lora_r, args.lora_alpha, args.lr,
                          args.accumulate, args.save_every, args.seed, progress, args.checkpoint_activations,
                          args.lora_targets and tuple(args.lora_targets.split(",")))
    finally:
        bar.close()
    if losses:
        print(f"npqwen: wrote {args.out} after {steps} steps (loss {losses[0]:.4f} -> {losses[-1]:.4f})")
    else:
        print(f"npqwen: wrote {args.out} (already trained for {steps} steps)")
    return 0
