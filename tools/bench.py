#!/usr/bin/env python3
"""npqwen vs HF transformers, side by side in one run, on the same checkpoint and prompts.

    python tools/bench.py                       # Qwen3-0.6B shape, random weights (built and cached)
    python tools/bench.py --model DIR --json    # any checkpoint; machine-readable output
    python tools/bench.py --markdown            # the table for the README

Each engine (npqwen, HF float32, HF bfloat16) runs in its own worker process, so load time and
peak RSS are its own; the machine's streaming bandwidth (sampled every 8 decode steps, with a
BLAS read of lm_head.weight) and float32 matmul throughput are measured on the spot, and the
figures are reported as ratios, which survive a noisy machine better than absolute times.
Prompts are random token ids; decoding is greedy with a KV cache; a decode figure is
1 / the median step time; a prefill figure is the best of --repeats runs; with --rounds the
engines take turns and each figure's best round counts.
"""
import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINES = ("npqwen", "hf-float32", "hf-bfloat16")
CACHE_DIR = Path(os.environ.get("NPQWEN_CACHE", Path.home() / ".cache" / "npqwen"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: a random Qwen3-0.6B-shape one, built once)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    p.add_argument("--prefill", default="128,1024", help="prompt lengths for prefill tokens/s")
    p.add_argument("--decode-prompts", default="16,2048", help="prompt lengths before decoding")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens decoded after each decode prompt")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each prefill; the best counts")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, alternating; each figure's best counts")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS threads = torch threads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", help="npqwen compute dtype (cuda: float16 or float32)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--markdown", action="store_true", help="print the README table")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.prefill = [int(n) for n in args.prefill.split(",") if n]
    args.decode_prompts = [int(n) for n in args.decode_prompts.split(",") if n]
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown engine(s) {', '.join(sorted(unknown))}")
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0

    model = Path(args.model) if args.model else default_checkpoint()
    report = {"machine": machine(args), "checkpoint": str(model), "rounds": args.rounds, "engines": {}}
    runs = {engine: [] for engine in engines}
    for r in range(args.rounds):
        for engine in engines:
            print(f"[bench] round {r + 1}/{args.rounds}: {engine} ...", file=sys.stderr, flush=True)
            runs[engine].append(spawn_worker(engine, model, args))
    for engine, results in runs.items():
        report["engines"][engine] = best_of(results)
    report["machine"].update(report["engines"].get("npqwen", {}).pop("machine", {}))
    report["figures"] = figures(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(markdown(report) if args.markdown else table(report))
    return 0


# ---------------------------------------------------------------------------- the checkpoint

def default_checkpoint() -> Path:
    """A random-weight bf16 checkpoint of the exact Qwen3-0.6B shape, written once by npqwen's own writer."""
    import numpy as np

    from npqwen.checkpoint import expected_shapes, save_safetensors
    from npqwen.config import QWEN3_0_6B_CONFIG, QWEN3_0_6B_GENERATION_CONFIG, Qwen3Config

    path = CACHE_DIR / "qwen3-0.6b-random"
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        return path
    print(f"[bench] building a random Qwen3-0.6B-shape checkpoint in {path} (once)", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shapes = expected_shapes(Qwen3Config.from_dict(QWEN3_0_6B_CONFIG))
    tensors = {name: np.ones(shape, np.float32) if name.endswith("norm.weight")
               else rng.standard_normal(shape, dtype=np.float32) * 0.02 for name, shape in shapes.items()}
    save_safetensors(path / "model.safetensors.tmp", tensors, "BF16")
    (path / "model.safetensors.tmp").rename(path / "model.safetensors")
    (path / "generation_config.json").write_text(json.dumps(QWEN3_0_6B_GENERATION_CONFIG, indent=2))
    (path / "config.json").write_text(json.dumps(QWEN3_0_6B_CONFIG, indent=2))
    return path


# ---------------------------------------------------------------------------- the machine

def machine(args) -> dict:
    import platform

    import numpy as np

    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "threads": args.threads, "python": platform.python_version(),
            "numpy": np.__version__}


def measure_matmul(weights: dict) -> float:
    """float32 matmul throughput (GFLOP/s): the best of 3 runs of x @ W.T, x of 1024 rows, for
    layer 0's four matmul shapes, using the model's own weights (nothing large is allocated)."""
    import numpy as np

    flops, seconds = 0, 0.0
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        w = weights[f"model.layers.0.{name}.weight"]
        a = np.ones((1024, w.shape[1]), w.dtype)
        seconds += _best(lambda: a @ w.T, 3)
        flops += 2 * 1024 * w.shape[0] * w.shape[1]
    return flops / seconds / 1e9


def bandwidth_probe(weights: dict):
    """A function that streams lm_head.weight (622 MB in Qwen3-0.6B) through a BLAS matrix-vector
    product, the fastest read NumPy does here, and returns the GB/s it achieved."""
    import numpy as np

    big = weights["lm_head.weight"]
    x = np.ones(big.shape[1], big.dtype)

    def probe() -> float:
        started = time.perf_counter()
        big @ x
        return big.nbytes / (time.perf_counter() - started) / 1e9
    return probe


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM; ru_maxrss would include the parent's, kept across exec)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _best(fn, n) -> float:
    """The shortest of n timed runs, after one untimed warm-up run."""
    fn()
    best = math.inf
    for _ in range(max(n, 1)):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------- the workers

def best_of(results: list[dict]) -> dict:
    """Each figure's best over the rounds: the highest rate, the lowest time and memory."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    best = dict(ok[0])
    for r in ok[1:]:
        for k, v in r.items():
            if k == "machine":
                best[k] = {m: max(best[k][m], v[m]) for m in v}
            elif k.endswith("_tps"):
                best[k] = max(best[k], v)
            elif k in ("load_s", "peak_rss_bytes"):
                best[k] = min(best[k], v)
    return best


def spawn_worker(engine: str, model: Path, args) -> dict:
    env = {**os.environ, **{v: str(args.threads) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                            "MKL_NUM_THREADS")}}
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(model), "--threads", str(args.threads),
           "--prefill", ",".join(map(str, args.prefill)), "--decode-prompts", ",".join(map(str, args.decode_prompts)),
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--device", args.device,
           "--dtype", args.dtype]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_worker(args) -> dict:
    """Load one engine, then time prefill and decode; runs in its own process."""
    import numpy as np

    rng = np.random.default_rng(0)
    started = time.perf_counter()
    engine = NpqwenEngine(args) if args.worker == "npqwen" else HFEngine(args)
    out = {"load_s": time.perf_counter() - started, **engine.sizes}
    on_cpu = args.worker == "npqwen" and args.device == "cpu"
    if on_cpu:   # the machine's figures, measured with npqwen's own arrays, during its own runs
        engine.probe = bandwidth_probe(engine.llm.weights)
        matmul = measure_matmul(engine.llm.weights)
    vocab = engine.vocab_size
    engine.prefill(rng.integers(0, vocab, 16).tolist(), capacity=16)   # warm-up
    for n in args.prefill:
        ids = rng.integers(0, vocab, n).tolist()
        out[f"prefill_{n}_tps"] = n / _best(lambda: engine.prefill(ids, capacity=n), args.repeats)
    for n in args.decode_prompts:
        ids = rng.integers(0, vocab, n).tolist()
        out[f"decode_{n}_tps"] = engine.decode(ids, args.new_tokens)
    if on_cpu:
        out["machine"] = {"bandwidth_GBps": sorted(engine.bandwidth)[len(engine.bandwidth) // 2],
                          "matmul_GFLOPs": max(matmul, measure_matmul(engine.llm.weights))}
    out["peak_rss_bytes"] = peak_rss_bytes()
    out["kv_cache_bytes"] = engine.kv_bytes(max(args.decode_prompts) + args.new_tokens)
    return out


def kv_cache_bytes(config, capacity: int, itemsize: int) -> int:
    """Keys and values of every layer for `capacity` positions (HF's config or npqwen's: same field names)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * capacity * itemsize


def decode_rate(steps: list[float]) -> float:
    """Tokens/s of a typical decode step: 1 / the median step time, which a burst of noise from
    other tenants of a shared machine moves far less than the mean."""
    return 1.0 / sorted(steps)[len(steps) // 2]


class NpqwenEngine:
    def __init__(self, args):
        import npqwen
        from npqwen.generate import decode_one_token, prefill

        self.llm = npqwen.load(args.model, device=args.device, dtype=args.dtype)
        self.model, self._prefill, self._decode = self.llm.model, prefill, decode_one_token
        self.vocab_size = self.llm.config.vocab_size
        self.probe, self.bandwidth = None, []   # a bandwidth probe runs every 8 decode steps, if set
        unique = {id(a): a for a in self.llm.weights.values()}.values()
        self.sizes = {"weight_bytes": sum(a.nbytes for a in unique), "params": sum(a.size for a in unique)}

    def prefill(self, ids, capacity):
        cache = self.model.new_cache(capacity)
        return int(self._prefill(self.model, ids, cache).argmax())

    def decode(self, ids, new_tokens) -> float:
        cache = self.model.new_cache(len(ids) + new_tokens)
        token = int(self._prefill(self.model, ids, cache).argmax())
        steps = []
        for step in range(new_tokens - 1):
            if self.probe is not None and step % 8 == 0:   # streaming bandwidth, under the same conditions
                self.bandwidth.append(self.probe())
            started = time.perf_counter()
            token = int(self._decode(self.model, token, cache).argmax())
            steps.append(time.perf_counter() - started)
        return decode_rate(steps)

    def kv_bytes(self, capacity) -> int:
        return kv_cache_bytes(self.model.config, capacity, self.model.dtype.itemsize)


class HFEngine:
    def __init__(self, args):
        import torch
        from transformers import Qwen3ForCausalLM

        torch.set_num_threads(args.threads)
        self.torch = torch
        dtype = getattr(torch, args.worker.split("-")[1])
        self.device = args.device
        self.model = Qwen3ForCausalLM.from_pretrained(args.model, dtype=dtype).eval().to(args.device)
        self.vocab_size = self.model.config.vocab_size
        params = {p.data_ptr(): p for p in self.model.parameters()}.values()
        self.sizes = {"weight_bytes": sum(p.numel() * p.element_size() for p in params),
                      "params": sum(p.numel() for p in params)}
        self.itemsize = torch.finfo(dtype).bits // 8

    def prefill(self, ids, capacity):
        with self.torch.inference_mode():
            x = self.torch.tensor([ids], device=self.device)
            out = self.model(x, use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax()), out

    def decode(self, ids, new_tokens) -> float:
        token, out = self.prefill(ids, len(ids) + new_tokens)
        cache = getattr(out, "cache", None) or out.past_key_values
        steps = []
        with self.torch.inference_mode():
            for _ in range(new_tokens - 1):
                started = time.perf_counter()
                out = self.model(self.torch.tensor([[token]], device=self.device), past_key_values=cache,
                                 use_cache=True)
                cache = getattr(out, "cache", None) or out.past_key_values
                token = int(out.logits[0, -1].argmax())
                steps.append(time.perf_counter() - started)
        return decode_rate(steps)

    def kv_bytes(self, capacity) -> int:
        return kv_cache_bytes(self.model.config, capacity, self.itemsize)


# ---------------------------------------------------------------------------- figures and tables

def figures(report) -> dict:
    """Ratios and bounds from the raw measurements."""
    m, e = report["machine"], report["engines"]
    ours = e.get("npqwen", {})
    f = {}
    if "error" in ours or not ours:
        return f
    dec = sorted(int(k.split("_")[1]) for k in ours if k.startswith("decode_"))
    pre = sorted(int(k.split("_")[1]) for k in ours if k.startswith("prefill_"))
    short, long = (f"decode_{dec[0]}_tps", f"decode_{dec[-1]}_tps") if dec else (None, None)
    if "bandwidth_GBps" in m and short:
        f["decode_bound_tps"] = m["bandwidth_GBps"] * 1e9 / ours["weight_bytes"]
        f["decode_pct_of_bound"] = 100 * ours[short] / f["decode_bound_tps"]
    if short and long != short:
        f["long_over_short_decode_pct"] = 100 * ours[long] / ours[short]
    for peer in ("hf-bfloat16", "hf-float32"):
        if short and short in e.get(peer, {}):
            f[f"decode_vs_{peer}"] = ours[short] / e[peer][short]
        if pre and f"prefill_{pre[-1]}_tps" in e.get(peer, {}):
            f[f"prefill_{pre[-1]}_vs_{peer}"] = ours[f"prefill_{pre[-1]}_tps"] / e[peer][f"prefill_{pre[-1]}_tps"]
    if pre and "matmul_GFLOPs" in m:
        T = pre[-1]
        flops = prefill_flops(report["checkpoint"], T)
        f[f"prefill_{T}_GFLOPs"] = flops * ours[f"prefill_{T}_tps"] / T / 1e9
        f[f"prefill_{T}_pct_of_matmul"] = 100 * f[f"prefill_{T}_GFLOPs"] / m["matmul_GFLOPs"]
    f["rss_over_weights_plus_kv"] = ours["peak_rss_bytes"] / (ours["weight_bytes"] + ours["kv_cache_bytes"])
    return f


def prefill_flops(checkpoint, T) -> float:
    """Multiply-adds x 2 of a T-token prefill: every layer's matmuls, causal attention, one lm_head row."""
    from npqwen.config import Qwen3Config

    c = Qwen3Config.from_json(Path(checkpoint) / "config.json")
    D, F, H, K, Dh = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    per_token = c.num_hidden_layers * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F)
    attention = c.num_hidden_layers * H * Dh * 2 * (T * (T + 1) / 2)   # q k^T and p v over the causal triangle
    return 2 * (per_token * T + attention + D * c.vocab_size)


TARGETS = [  # (figure, comparison, threshold, label)
    ("decode_vs_hf-bfloat16", ">=", 1.1, "decode (short prompt) vs HF bfloat16"),
    ("decode_vs_hf-float32", ">=", 1.8, "decode (short prompt) vs HF float32"),
    ("decode_pct_of_bound", ">=", 85, "decode, % of the bandwidth bound"),
    ("long_over_short_decode_pct", ">=", 70, "decode after the long prompt, % of short"),
    ("prefill_1024_vs_hf-float32", ">=", 1.1, "prefill 1024 vs HF float32"),
    ("prefill_1024_pct_of_matmul", ">=", 75, "prefill 1024, % of float32 matmul throughput"),
    ("rss_over_weights_plus_kv", "<=", 1.2, "peak RSS / (float32 weights + KV cache)"),
]


def rows(report):
    e = report["engines"]
    names = list(e)
    keys = ["load_s"] + sorted({k for v in e.values() for k in v if k.endswith("_tps")},
                               key=lambda k: (k.split("_")[0], int(k.split("_")[1]))) + ["peak_rss_bytes"]
    out = []
    for k in keys:
        label = {"load_s": "load (s)", "peak_rss_bytes": "peak RSS (GB)"}.get(k) or \
            f"{k.split('_')[0]} tok/s ({k.split('_')[1]}-token prompt)"
        cells = []
        for n in names:
            v = e[n].get(k)
            cells.append("-" if v is None else f"{v / 1e9:.2f}" if k == "peak_rss_bytes" else f"{v:.2f}"
                         if k == "load_s" else f"{v:.1f}")
        out.append((label, cells))
    return names, out


def target_lines(report):
    f = report["figures"]
    lines = []
    for key, op, threshold, label in TARGETS:
        if key in f:
            ok = f[key] >= threshold if op == ">=" else f[key] <= threshold
            unit = "x" if "vs" in key or "over_weights" in key else "%"
            lines.append((label, f"{f[key]:.2f}{unit}" if unit == "x" else f"{f[key]:.0f}%",
                          f"{op} {threshold}{unit}", "yes" if ok else "NO"))
    return lines


def table(report) -> str:
    m = report["machine"]
    names, body = rows(report)
    width = max(len(r[0]) for r in body)
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, numpy {m['numpy']}"]
    if "bandwidth_GBps" in m:
        lines.append(f"measured: streaming read {m['bandwidth_GBps']:.1f} GB/s, float32 matmul "
                     f"{m['matmul_GFLOPs']:.0f} GFLOP/s")
    lines.append(f"checkpoint: {report['checkpoint']}")
    lines.append("")
    lines.append(" " * width + "  " + "  ".join(f"{n:>12}" for n in names))
    for label, cells in body:
        lines.append(f"{label:<{width}}  " + "  ".join(f"{c:>12}" for c in cells))
    for n in names:
        if "error" in report["engines"][n]:
            lines.append(f"{n}: {report['engines'][n]['error']}")
    f = report["figures"]
    if "decode_bound_tps" in f:
        lines.append(f"\ndecode bound: {f['decode_bound_tps']:.1f} tok/s (weights read per token / bandwidth)")
    lines.append("\ntarget                                          measured    target   met")
    for label, value, target, ok in target_lines(report):
        lines.append(f"{label:<46}  {value:>8}  {target:>8}   {ok}")
    return "\n".join(lines)


def markdown(report) -> str:
    m = report["machine"]
    names, body = rows(report)
    out = [f"Machine: {m['cpu']}, {m['cores']} cores, BLAS/torch threads {m['threads']}, numpy {m['numpy']}, "
           f"Python {m['python']}." + (f" Measured on the spot: streaming read {m['bandwidth_GBps']:.1f} GB/s, "
                                       f"float32 matmul {m['matmul_GFLOPs']:.0f} GFLOP/s." if "bandwidth_GBps" in m
                                       else ""), "",
           "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in body]
    out += ["", "| target | measured | wanted | met |", "|---|---:|---:|---|"]
    out += [f"| {label} | {value} | {target} | {ok} |" for label, value, target, ok in target_lines(report)]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
