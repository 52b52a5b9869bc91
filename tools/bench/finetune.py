"""finetune: one LoRA training step's speed and memory, npqwen (npqwen/finetune.py, no torch) against PEFT + torch
float32 on the CPU. The Qwen3-0.6B shape with --finetune-layers (4) layers and the full vocabulary, random float32
weights (its own checkpoint, built once), an adapter of rank 16 on all seven projections of every layer, one
example of --finetune-tokens (256) random tokens per step (the loss on its second half), AdamW; tokens/s over
--finetune-steps (3) steps after one untimed step, and the worker's peak RSS. QLoRA's way beside it: the same steps
on a frozen compact base (--finetune-weights, default int8 and bfloat16: the bench's stored checkpoints of
tools/bench/weights.py, loaded as stored), each in its own process, against npqwen's float32 base."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.bench.engines import CACHE_DIR, random_weights

NAME, WORKER, NEEDS = "finetune", "single", ()
OWN_MODEL = True      # its workers load the checkpoint below, not --model
TARGETS = [("finetune_vs_hf-float32", ">=", 0.8, "finetune: npqwen tokens/s vs PEFT + torch float32"),
           ("finetune_memory_vs_hf-float32", "<=", 1.0, "finetune: npqwen peak RSS vs PEFT + torch float32")]


def add_arguments(p):
    p.add_argument("--finetune-layers", type=int, default=4, help="finetune: layers of the 0.6B-shaped model")
    p.add_argument("--finetune-tokens", type=int, default=256, help="finetune: tokens of each step's example")
    p.add_argument("--finetune-steps", type=int, default=3, help="finetune: steps timed")
    p.add_argument("--finetune-weights", default="int8,bfloat16",
                   help="finetune: compact bases to train a LoRA on as well (QLoRA's way; '' for none)")


def runs_on(engine, args) -> bool:
    return engine in ("npqwen", "hf-float32")


def checkpoint(layers: int):
    """A float32 Qwen3-0.6B-shaped checkpoint of `layers` layers and a fresh adapter on it, written once."""
    import npqwen
    from npqwen.checkpoint import save_safetensors
    from npqwen.config import QWEN3_0_6B_CONFIG
    from npqwen.finetune import TARGETS, new_adapter, save_adapter

    path = CACHE_DIR / f"qwen3-0.6b-{layers}-layers-f32"
    if (path / "adapter" / "adapter_model.safetensors").is_file():
        return path
    print(f"[bench] building {path} (once)", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(QWEN3_0_6B_CONFIG, num_hidden_layers=layers, max_window_layers=layers)
    save_safetensors(path / "model.safetensors", random_weights(config), "F32")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_adapter(new_adapter(npqwen.load(path).model, r=16, alpha=32, targets=TARGETS), path / "adapter")
    return path


def run(engine, args, rng) -> dict:
    import numpy as np

    path, examples = checkpoint(args.finetune_layers), data(args.finetune_tokens, args.finetune_steps)
    if engine == "npqwen":
        out = {}
        for fmt in [f for f in args.finetune_weights.split(",") if f]:   # QLoRA: each base in its own process
            out.update({f"{k}_{fmt}": v for k, v in compact_base(fmt, args).items()})
        return {**out, **npqwen_steps(path, "float32", examples)}
    else:
        import peft
        import torch
        from transformers import Qwen3ForCausalLM

        model = peft.PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32),
                                               path / "adapter", is_trainable=True).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step(ex):
            optimizer.zero_grad()
            labels = torch.from_numpy(np.append(-100, ex.targets[:-1]))[None]   # HF shifts the labels itself
            loss = model(input_ids=torch.from_numpy(ex.ids)[None], labels=labels).loss
            loss.backward()
            optimizer.step()
            return loss.item()
    return timed(step, examples)


def timed(step, examples) -> dict:
    """One untimed step, then the others timed; tokens/s, the first loss and the process's peak RSS."""
    from tools.bench.machine import peak_rss_bytes

    first = step(examples[0])                                                  # untimed
    started = time.perf_counter()
    for ex in examples[1:]:
        step(ex)
    seconds = time.perf_counter() - started
    return {"finetune_tokens_per_s": sum(len(ex.ids) for ex in examples[1:]) / seconds, "finetune_first_loss": first,
            "finetune_peak_rss_bytes": peak_rss_bytes()}


def npqwen_steps(path, weights: str, examples) -> dict:
    """npqwen's LoRA training steps on the base at `path` kept as `weights` (float32, or a compact format)."""
    import npqwen
    from npqwen.finetune import TARGETS, AdamW, new_adapter, train_step

    llm = npqwen.load(path, weights=weights)
    adapter = new_adapter(llm.model, r=16, alpha=32, targets=TARGETS)   # all seven (PEFT's default: q, v)
    optimizer = AdamW(adapter.weights, lr=1e-4)
    return timed(lambda ex: train_step(llm.model, adapter, [ex], optimizer), examples)   # forward, backward, AdamW


def compact_base(fmt: str, args) -> dict:
    """npqwen_steps on the bench's 0.6B-shape checkpoint stored in `fmt`, in a process of its own (its peak RSS)."""
    from tools.bench.weights import checkpoint as stored

    path = stored(fmt, args.finetune_layers)
    code = (f"import json\nfrom tools.bench.finetune import npqwen_steps, data\n"
            f"print(json.dumps(npqwen_steps({str(path)!r}, 'stored', data({args.finetune_tokens}, "
            f"{args.finetune_steps}))))\n")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})   # the worker's BLAS threads too
    if result.returncode != 0:
        raise RuntimeError(f"finetune on a {fmt} base: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def data(T: int, steps: int) -> list:
    """steps + 1 examples of T random tokens, the loss on the second half."""
    import numpy as np

    from npqwen.finetune import example

    rng = np.random.default_rng(0)
    return [example(rng.integers(0, 150000, T // 2).tolist(), rng.integers(0, 150000, T - T // 2).tolist())
            for _ in range(steps + 1)]


def figures(report) -> dict:
    ours, theirs, f = report["engines"].get("npqwen", {}), report["engines"].get("hf-float32", {}), {}
    if "finetune_tokens_per_s" in ours and "finetune_tokens_per_s" in theirs:
        f["finetune_vs_hf-float32"] = ours["finetune_tokens_per_s"] / theirs["finetune_tokens_per_s"]
        f["finetune_memory_vs_hf-float32"] = ours["finetune_peak_rss_bytes"] / theirs["finetune_peak_rss_bytes"]
    for key in ours:   # QLoRA: each compact base against npqwen's float32 base
        if key.startswith("finetune_tokens_per_s_") and "finetune_tokens_per_s" in ours:
            fmt = key[len("finetune_tokens_per_s_"):]
            f[f"finetune_{fmt}_vs_float32"] = ours[key] / ours["finetune_tokens_per_s"]
            f[f"finetune_memory_{fmt}_vs_float32"] = ours[f"finetune_peak_rss_bytes_{fmt}"] / \
                ours["finetune_peak_rss_bytes"]
    return f


def rows(report) -> list:
    from tools.bench.tables import row

    return [row(report, "finetune_tokens_per_s", "LoRA training tokens/s"),
            row(report, "finetune_peak_rss_bytes", "LoRA training peak RSS (GB)", "{:.2f}", 1e9),
            row(report, "finetune_first_loss", "first step's loss", "{:.5f}")]


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    return []
