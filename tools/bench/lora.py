"""lora: what LoRA adapters cost (npqwen). A batch-1 decode step (one sequence, --lora-context cached
positions) through one adapter of rank --lora-rank on all seven projections vs the base model alone;
and one decode step of --lora-batch sequences mixing 4 such adapters (round robin) vs none. Each
figure is the median of --lora-steps steps, the two runs taken in turn. The adapters are random,
written as PEFT writes them and read back with npqwen.lora.read_adapter. Beside them, the adapter's own
products alone for one row (npqwen.lora.add over every layer), which a loaded machine does not blur."""
import json
import statistics
import tempfile
import time
from pathlib import Path

from tools.bench.machine import best_time

NAME, WORKER, NEEDS = "lora", "single", ()
TARGETS = [("lora_decode_overhead_pct", "<=", 15, "batch-1 decode, one adapter on all seven projections vs none: "
                                                   "% more time"),
           ("lora_step_overhead_pct", "<=", 25, "decode step mixing 4 adapters vs none: % more time"),
           ("lora_decode_adds_pct", ">=", 0, "batch-1 decode: the adapter's products alone, % of the base step")]
ROWS = {"lora_decode_base_s": "batch-1 decode step, no adapter (s)",
        "lora_decode_lora_s": "batch-1 decode step, one adapter (s)",
        "lora_decode_adds_s": "  the adapter's products alone (s)",
        "lora_step_base_s": "batched decode step, no adapter (s)",
        "lora_step_lora_s": "batched decode step, 4 adapters (s)"}


def add_arguments(p):
    p.add_argument("--lora-rank", type=int, default=16, help="lora: the adapters' rank")
    p.add_argument("--lora-context", type=int, default=128, help="lora: cached positions of each sequence")
    p.add_argument("--lora-batch", type=int, default=32, help="lora: sequences in the mixed step")
    p.add_argument("--lora-steps", type=int, default=16, help="lora: steps timed per figure (median)")


def runs_on(engine, args) -> bool:
    return engine == "npqwen"


def write_adapter(path: Path, llm, r: int, seed: int) -> Path:
    """A random PEFT-shaped adapter of rank r on every layer's seven projections."""
    import numpy as np

    from npqwen.checkpoint import save_safetensors
    from npqwen.lora import ATTENTION, TARGETS as PROJECTIONS

    rng, tensors = np.random.default_rng(seed), {}
    for i in range(llm.config.num_hidden_layers):
        for t in PROJECTIONS:
            module = f"model.layers.{i}.{'self_attn' if t in ATTENTION else 'mlp'}.{t}"
            out, in_ = llm.weights[f"{module}.weight"].shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = 0.01 * rng.standard_normal((r, in_), np.float32)
            tensors[f"base_model.model.{module}.lora_B.weight"] = 0.01 * rng.standard_normal((out, r), np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(path / "adapter_model.safetensors", tensors)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                          "target_modules": list(PROJECTIONS)}))
    return path


def run(engine, args, rng) -> dict:
    import numpy as np

    from npqwen.kv_cache import Batch, KVCache
    from npqwen.lora import read_adapter

    model, cfg, xp = engine.model, engine.llm.config, engine.model.xp
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [read_adapter(write_adapter(Path(tmp) / f"a{k}", engine.llm, args.lora_rank, k), f"a{k}", model)
                    for k in range(4)]
    S = args.lora_context
    P, per_seq = S + 1, 1                     # one page per sequence: the KV pool no larger than it must be

    def step_of(B: int):
        """A decode step of B sequences with S cached positions each, run with `loras` (one per sequence)."""
        kv = KVCache(cfg, B * per_seq, P, xp, model.dtype)
        kv.keys.fill(0.01)
        kv.values.fill(0.01)
        ids = np.random.default_rng(1).integers(0, engine.vocab_size, B)
        tables = [np.arange(b * per_seq, (b + 1) * per_seq) for b in range(B)]

        def step(loras):
            batch = Batch(ids, [S] * B, [1] * B, tables, P, sample_rows=np.arange(B), loras=loras)
            return xp.asarray(model.forward_batch(batch, kv).logits)[0, 0].item()   # on CuPy: wait for the GPU
        return step

    def medians(step, base, lora) -> tuple[float, float]:
        """The median step time of each way, taken in turn (after one untimed run of each)."""
        times = {0: [], 1: []}
        step(base), step(lora)
        for _ in range(args.lora_steps):
            for k, loras in ((0, base), (1, lora)):
                started = time.perf_counter()
                step(loras)
                times[k].append(time.perf_counter() - started)
        return statistics.median(times[0]), statistics.median(times[1])

    def adds_alone(adapter):
        """lora.add of every adapted matrix for one row, on outputs of the model's widths."""
        from npqwen.lora import add

        groups, work = [(adapter, slice(None))], []
        for matrix, ds in adapter.deltas.items():
            width = (model.fused.get(f"{matrix}.weight") if f"{matrix}.weight" in model.fused
                     else model.weights[f"{matrix}.weight"]).shape[0]
            work.append((xp.zeros((1, width), model.dtype), xp.ones((1, ds[0].A.shape[1]), model.dtype), matrix))
        for out, x, matrix in work:
            add(out, x, groups, matrix)
        return xp.asarray(work[-1][0])[0, 0].item()

    B = args.lora_batch
    out = {"lora_decode_adds_s": best_time(lambda: adds_alone(adapters[0]), args.lora_steps)}
    out["lora_decode_base_s"], out["lora_decode_lora_s"] = medians(step_of(1), [None], [adapters[0]])
    out["lora_step_base_s"], out["lora_step_lora_s"] = medians(step_of(B), [None] * B,
                                                               [adapters[b % 4] for b in range(B)])
    return out


def figures(report) -> dict:
    ours, f = report["engines"].get("npqwen", {}), {}
    if "lora_decode_base_s" in ours:
        f["lora_decode_overhead_pct"] = 100 * (ours["lora_decode_lora_s"] / ours["lora_decode_base_s"] - 1)
        f["lora_step_overhead_pct"] = 100 * (ours["lora_step_lora_s"] / ours["lora_step_base_s"] - 1)
        f["lora_decode_adds_pct"] = 100 * ours["lora_decode_adds_s"] / ours["lora_decode_base_s"]
    return f


def rows(report) -> list:
    from tools.bench.tables import row

    return [row(report, key, label, "{:.4f}") for key, label in ROWS.items()
            if any(key in figures for figures in report["engines"].values())]


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    return []
