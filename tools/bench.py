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

Suites (--suites, comma-separated, or all; the default is prefill,decode):
    prefill   prefill tokens/s of each --prefill prompt, one sequence
    decode    decode tokens/s after each --decode-prompts prompt, one sequence (prefill/decode_one_token)
    batch1    the same decode as a batch of one through npqwen.Engine (the step time of its one
              running request), as a % of the decode figure; implies decode
    serving   --serving-requests (64) requests arriving at once: random prompt ids, prompt lengths
              and max_new_tokens uniform in --serving-prompt-lens / --serving-output-lens, eos
              ignored, fixed seed. npqwen's engine runs all of them; the baselines (npqwen one
              request after another; HF float32 and bfloat16 in static, left-padded batches of
              --serving-batch, each batch running to its longest request) run only the first
              --serving-sample (16) requests and report rates from that sample, since they are
              the slow part of the run (their total and time to first token cover only those
              requests). Also: the workload's linear-layer FLOPs over the measured float32
              matmul rate (a bound on the engine's time), and peak RSS against the weights plus
              the engine's KV pool (--serving-kv-tokens).
    prefix    --prefix-requests (16) requests sharing a --prefix-tokens (1024) system prompt plus
              32 tokens of their own, run one at a time: time to first token cold vs cached.
    step      the many-token steps: a --step-prefill (1024) token prefill (chunks of 512), and one
              decode step of --step-batch (32) sequences with --step-context (512) cached positions
              each (npqwen: one engine Batch over a filled paged KV cache; HF: a batched forward
              with a DynamicCache). For npqwen, beside each: its linear layers alone at the same
              shapes (ops.linear on the model's own weights), and their share of the step.
              --profile prints a cProfile table of npqwen's two steps to stderr.

    python tools/bench.py --suites batch1,serving,prefix    # the serving benchmark alone

prefill, decode and batch1 share one worker process per engine and round; serving and prefix run
in another worker per engine, once whatever --rounds says, so their peak RSS is their own.
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
SUITES = ("prefill", "decode", "batch1", "serving", "prefix", "step")
SINGLE_SUITES = ("prefill", "decode", "batch1", "step")   # one sequence at a time: a worker per engine and round
SERVING_SUITES = ("serving", "prefix")            # many requests: a worker per engine, run once
SERVING_SEED = 0                                  # the serving workload and the prefix case are fixed
PREFIX_SUFFIX_TOKENS, PREFIX_NEW_TOKENS = 32, 4   # prefix case: each request's own tokens, tokens generated
CACHE_DIR = Path(os.environ.get("NPQWEN_CACHE", Path.home() / ".cache" / "npqwen"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: a random Qwen3-0.6B-shape one, built once)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    p.add_argument("--suites", default="prefill,decode", help=f"comma-separated, from {', '.join(SUITES)}; or all")
    p.add_argument("--prefill", default="128,1024", help="prompt lengths for prefill tokens/s")
    p.add_argument("--decode-prompts", default="16,2048", help="prompt lengths before decoding")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens decoded after each decode prompt")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each prefill; the best counts")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, alternating; each figure's best counts "
                        "(prefill, decode, batch1 only)")
    p.add_argument("--serving-requests", type=int, default=64,
                   help="serving: requests arriving at once; npqwen's engine runs them all")
    p.add_argument("--serving-sample", type=int, default=16,
                   help="serving: the baselines (npqwen one by one, HF static batches) run only the first N "
                        "requests and report rates from them; 0 skips them")
    p.add_argument("--serving-prompt-lens", default="32-512", help="serving: prompt lengths, uniform in MIN-MAX")
    p.add_argument("--serving-output-lens", default="16-256",
                   help="serving: max_new_tokens, uniform in MIN-MAX (eos is ignored: each runs to its own)")
    p.add_argument("--serving-batch", type=int, default=16, help="serving: HF static batch size")
    p.add_argument("--serving-kv-tokens", type=int,
                   help="serving: npqwen's KV pool in positions (default: every request at its longest at "
                        "once, in whole pages: 64 x 768 with the defaults)")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="prefix: the shared system prompt's length")
    p.add_argument("--prefix-requests", type=int, default=16, help="prefix: requests sharing it, one at a time")
    p.add_argument("--step-prefill", type=int, default=1024, help="step: prompt length of the prefill step")
    p.add_argument("--step-batch", type=int, default=32, help="step: decoding sequences in the batched step")
    p.add_argument("--step-context", type=int, default=512, help="step: cached positions of each of them")
    p.add_argument("--profile", action="store_true", help="step: cProfile npqwen's steps (table on stderr)")
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
    suites = set(SUITES) if args.suites == "all" else {s for s in args.suites.split(",") if s}
    if suites - set(SUITES):
        p.error(f"unknown suite(s) {', '.join(sorted(suites - set(SUITES)))}; choose from {', '.join(SUITES)}")
    if "batch1" in suites:
        suites.add("decode")     # its figure is a % of the single-sequence decode, measured beside it
    args.suites = suites
    try:
        args.serving_prompt_lens = length_range(args.serving_prompt_lens)
        args.serving_output_lens = length_range(args.serving_output_lens)
    except ValueError as e:
        p.error(str(e))
    if args.serving_requests < 1 or args.serving_batch < 1 or args.prefix_requests < 1 or args.prefix_tokens < 1:
        p.error("--serving-requests, --serving-batch, --prefix-requests and --prefix-tokens must be >= 1")
    args.serving_sample = max(0, min(args.serving_sample, args.serving_requests))
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0

    model = Path(args.model) if args.model else default_checkpoint()
    report = {"machine": machine(args), "checkpoint": str(model), "rounds": args.rounds,
              "suites": [s for s in SUITES if s in suites], "engines": {}}
    single = [s for s in SINGLE_SUITES if s in suites]
    if single:
        runs = {engine: [] for engine in engines}
        for r in range(args.rounds):
            for engine in engines:
                print(f"[bench] round {r + 1}/{args.rounds}: {engine} ...", file=sys.stderr, flush=True)
                runs[engine].append(spawn_worker(engine, model, args, single))
        for engine, results in runs.items():
            report["engines"][engine] = best_of(results)
        merge_machine(report["machine"], report["engines"].get("npqwen", {}).pop("machine", {}))
    if suites & set(SERVING_SUITES):
        report["serving"] = run_serving(model, args, engines)
        merge_machine(report["machine"], report["serving"].pop("machine", {}))
    report["figures"] = figures(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(markdown(report) if args.markdown else table(report))
    return 0


def length_range(text: str) -> tuple[int, int]:
    """"32-512" -> (32, 512); "64" -> (64, 64)."""
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range is MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def merge_machine(machine: dict, measured: dict):
    """Add a worker's measurements of the machine; a figure measured twice keeps its best."""
    for k, v in measured.items():
        machine[k] = max(machine.get(k, v), v)


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
            elif k in ("load_s", "peak_rss_bytes") or k.startswith("step_"):
                best[k] = min(best[k], v)
    return best


def spawn_worker(engine: str, model: Path, args, suites: list[str]) -> dict:
    env = {**os.environ, **{v: str(args.threads) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                            "MKL_NUM_THREADS")}}
    cmd = [sys.executable, __file__, "--worker", engine, "--model", str(model), "--threads", str(args.threads),
           "--suites", ",".join(suites),
           "--prefill", ",".join(map(str, args.prefill)), "--decode-prompts", ",".join(map(str, args.decode_prompts)),
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--device", args.device,
           "--dtype", args.dtype, "--serving-requests", str(args.serving_requests),
           "--serving-sample", str(args.serving_sample), "--serving-prompt-lens", "%d-%d" % args.serving_prompt_lens,
           "--serving-output-lens", "%d-%d" % args.serving_output_lens, "--serving-batch", str(args.serving_batch),
           "--prefix-tokens", str(args.prefix_tokens), "--prefix-requests", str(args.prefix_requests),
           "--step-prefill", str(args.step_prefill), "--step-batch", str(args.step_batch),
           "--step-context", str(args.step_context)] + (["--profile"] if args.profile else [])
    if args.serving_kv_tokens:
        cmd += ["--serving-kv-tokens", str(args.serving_kv_tokens)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if args.profile and result.stderr:
        print(result.stderr, file=sys.stderr)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_worker(args) -> dict:
    """Load one engine, then run this worker's suites; runs in its own process."""
    started = time.perf_counter()
    engine = NpqwenEngine(args) if args.worker == "npqwen" else HFEngine(args)
    out = {"load_s": time.perf_counter() - started, **engine.sizes}
    if args.suites & set(SINGLE_SUITES):
        out.update(single_sequence(engine, args))
    if args.suites & set(SERVING_SUITES):
        out.update(engine.serving(args))
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def single_sequence(engine, args) -> dict:
    """Prefill and decode of one sequence (and, for npqwen with batch1, the same decode through the engine)."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    on_cpu = args.worker == "npqwen" and args.device == "cpu"
    if on_cpu:   # the machine's figures, measured with npqwen's own arrays, during its own runs
        engine.probe = bandwidth_probe(engine.llm.weights)
        matmul = measure_matmul(engine.llm.weights)
    vocab = engine.vocab_size
    engine.prefill(rng.integers(0, vocab, 16).tolist(), capacity=16)   # warm-up
    if "prefill" in args.suites:
        for n in args.prefill:
            ids = rng.integers(0, vocab, n).tolist()
            out[f"prefill_{n}_tps"] = n / _best(lambda: engine.prefill(ids, capacity=n), args.repeats)
    if "decode" in args.suites:
        for n in args.decode_prompts:
            ids = rng.integers(0, vocab, n).tolist()
            out[f"decode_{n}_tps"] = engine.decode(ids, args.new_tokens)
            if "batch1" in args.suites and args.worker == "npqwen":   # same prompt, right after: same conditions
                out[f"batch1_{n}_tps"] = engine.engine_decode(ids, args.new_tokens)
    if "step" in args.suites:
        out.update(engine.steps(args))
    if on_cpu:
        out["machine"] = {"matmul_GFLOPs": max(matmul, measure_matmul(engine.llm.weights))}
        if engine.bandwidth:
            out["machine"]["bandwidth_GBps"] = sorted(engine.bandwidth)[len(engine.bandwidth) // 2]
    if "decode" in args.suites:   # the step suite's KV cache is its own, not this one
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

    def steps(self, args) -> dict:
        """The step suite: each step's time (best of --repeats) and its linear layers' alone."""
        import numpy as np

        from npqwen.generate import PREFILL_CHUNK
        from npqwen.model import Batch, KVCache

        rng, cfg, xp = np.random.default_rng(1), self.llm.config, self.model.xp
        T = args.step_prefill
        ids = rng.integers(0, self.vocab_size, T).tolist()
        chunks = [min(PREFILL_CHUNK, T - s) for s in range(0, T, PREFILL_CHUNK)]
        # B sequences of `context` cached positions, each decoding one token; keys and values filled
        # (zero pages that were never written would be read from the OS's shared zero page: too fast)
        B, S, P = args.step_batch, args.step_context, 256
        per_seq = -(-(S + 1) // P)
        kv = KVCache(cfg, B * per_seq, P, xp, self.model.dtype)
        kv.keys.fill(0.01)
        kv.values.fill(0.01)
        batch = Batch(rng.integers(0, self.vocab_size, B), [S] * B, [1] * B,
                      [np.arange(b * per_seq, (b + 1) * per_seq) for b in range(B)], P, sample_rows=np.arange(B))
        prefill = lambda: self.prefill(ids, T)                                          # noqa: E731
        step = lambda: xp.asarray(self.model.forward_batch(batch, kv))[0, 0].item()     # noqa: E731
        out = {"step_prefill_s": _best(prefill, args.repeats),
               "step_prefill_matmul_s": _best(lambda: [self.linear_layers(n, 1) for n in chunks], args.repeats),
               "step_batch_s": _best(step, args.repeats),
               "step_batch_matmul_s": _best(lambda: self.linear_layers(B, B), args.repeats)}
        if args.profile:
            import cProfile
            import pstats
            for name, fn in (("prefill", prefill), ("batch", step)):
                profile = cProfile.Profile()
                profile.runcall(fn)
                print(f"\n[bench] npqwen {name} step, by own time:", file=sys.stderr)
                pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(12)
        return out

    def linear_layers(self, rows: int, sampled: int):
        """The step's linear layers alone: q/k/v, o, gate/up and down of every layer for `rows`
        tokens, and lm_head for `sampled` of them, through ops.linear as the model calls it."""
        from npqwen import ops

        xp, W, fused, cfg = self.model.xp, self.model.weights, self.model.fused, self.llm.config
        if getattr(self, "_inputs", (None,))[0] != rows:
            ones = lambda n: xp.ones((rows, n), dtype=self.model.dtype)                  # noqa: E731
            self._inputs = (rows, ones(cfg.hidden_size), ones(cfg.num_attention_heads * cfg.head_dim),
                            ones(cfg.intermediate_size))
        _, x, a, f = self._inputs
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            ops.linear(x, fused[f"{p}.self_attn.qkv_proj.weight"])
            ops.linear(a, W[f"{p}.self_attn.o_proj.weight"])
            ops.linear(x, fused[f"{p}.mlp.gate_up_proj.weight"])
            ops.linear(f, W[f"{p}.mlp.down_proj.weight"])
        y = ops.linear(x[:sampled], W["lm_head.weight"])
        return xp.asarray(y)[0, 0].item()   # on CuPy: wait for the GPU

    def engine_decode(self, ids, new_tokens) -> float:
        """The same decode as a batch of one through npqwen.Engine: 1 / the median step time once
        the request's first token is out (its steps from then on are decode steps)."""
        from npqwen import Engine

        engine = Engine(self.llm, kv_cache_tokens=whole_pages(len(ids) + new_tokens))
        req = add_fixed(engine, ids, new_tokens)
        steps = []
        while engine.has_unfinished():
            decoding = bool(req.output_ids)
            started = time.perf_counter()
            engine.step()
            if decoding:
                steps.append(time.perf_counter() - started)
        return decode_rate(steps)

    def serving(self, args) -> dict:
        """The serving workload through the engine (all at once), then one request after another
        (the first --serving-sample only), then the prefix case; what the suites ask for."""
        from npqwen import Engine

        prompts, outputs = serving_workload(args, self.vocab_size)
        out, N = {"serving": {}}, args.serving_sample
        if "serving" in args.suites:
            on_cpu = args.device == "cpu"
            matmul = measure_matmul(self.llm.weights) if on_cpu else None   # for the linear-layer bound
            kv_tokens = args.serving_kv_tokens or serving_kv_tokens(args)
            engine = Engine(self.llm, kv_cache_tokens=kv_tokens)
            out["serving"]["npqwen-engine"] = serve_all_at_once(engine, prompts, outputs)
            # Peak RSS now, before anything else runs in this process: the weights, the KV pool's
            # pages that were touched, and the engine's activations.
            out["memory"] = {"peak_rss_bytes": peak_rss_bytes(), "weight_bytes": self.sizes["weight_bytes"],
                             "kv_pool_bytes": engine.kv.nbytes, "kv_cache_tokens": kv_tokens}
            del engine
            if N:
                out["serving"]["npqwen-sequential"] = serve_one_by_one(self.llm, prompts[:N], outputs[:N])
            if on_cpu:
                out["machine"] = {"matmul_GFLOPs": max(matmul, measure_matmul(self.llm.weights))}
        if "prefix" in args.suites:
            out["prefix"] = prefix_case(self.llm, args)
        return out


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

    def steps(self, args) -> dict:
        """The step suite: the prefill, and one batched decode step over a DynamicCache of
        --step-context positions per sequence (filled directly, as npqwen's pages are)."""
        import numpy as np
        from transformers import DynamicCache

        torch, cfg = self.torch, self.model.config
        ids = np.random.default_rng(1).integers(0, self.vocab_size, args.step_prefill).tolist()
        B, S = args.step_batch, args.step_context
        cache = DynamicCache()
        shape = (B, cfg.num_key_value_heads, S, cfg.head_dim)
        for layer in range(cfg.num_hidden_layers):
            full = torch.full(shape, 0.01, dtype=self.model.dtype, device=self.device)
            cache.update(full, full.clone(), layer)
        tokens = torch.randint(0, self.vocab_size, (B, 1), device=self.device)

        def step():
            with torch.inference_mode():
                out = self.model(tokens, past_key_values=cache, use_cache=True)
            cache.crop(-1)   # back to S positions for the next run (transformers 5: a negative count drops)
            return float(out.logits[0, -1, 0])
        return {"step_prefill_s": _best(lambda: self.prefill(ids, len(ids)), args.repeats),
                "step_batch_s": _best(step, args.repeats)}

    def serving(self, args) -> dict:
        """The first --serving-sample requests of the serving workload, in static batches."""
        prompts, outputs = serving_workload(args, self.vocab_size)
        N = args.serving_sample
        return {"serving": {f"{args.worker}-static": self.serve_static(prompts[:N], outputs[:N], args.serving_batch)}}

    def serve_static(self, prompts, outputs, batch_size) -> dict:
        """Static batching: batches of batch_size in arrival order, left-padded (masked), each one
        generating greedily until its longest request is done; the next batch starts after it.
        A request counts its own max_new_tokens only, so padding and the tokens generated past
        its own length are work done but not counted."""
        torch = self.torch
        clock = TokenClock()

        def generate(group):
            T, longest = max(len(ids) for ids, _ in group), max(n for _, n in group)
            ids = torch.zeros((len(group), T), dtype=torch.long)          # (B, T), 0 where padded
            mask = torch.zeros((len(group), T), dtype=torch.long)         # (B, T), 1 on real tokens
            for i, (prompt, _) in enumerate(group):                         # left padding: prompts end at T - 1
                ids[i, T - len(prompt):] = torch.tensor(prompt)
                mask[i, T - len(prompt):] = 1
            clock.times = None
            with torch.inference_mode():   # min_new_tokens = max_new_tokens: eos is suppressed, the length fixed
                self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                    pad_token_id=0, streamer=clock)
            return clock.times                                              # one time per generated step

        generate([(prompts[0][:8], 2)] * 2)   # warm-up
        start, records = time.perf_counter(), []
        for b in range(0, len(prompts), batch_size):
            group = list(zip(prompts[b:b + batch_size], outputs[b:b + batch_size]))
            times = generate(group)
            records += [(len(ids), n, times[:n]) for ids, n in group]
        return serving_summary(records, start, time.perf_counter())


class TokenClock:
    """A transformers streamer (duck-typed BaseStreamer) that notes when each generation step's
    tokens come out; generate() first puts the prompt, then the batch's new tokens every step."""

    def __init__(self):
        self.times = None

    def put(self, value):
        if self.times is None:
            self.times = []                           # the prompt: generation starts now
        else:
            self.times.append(time.perf_counter())    # the tokens of one step

    def end(self):
        pass


# ---------------------------------------------------------------------------- serving

def serving_workload(args, vocab_size) -> tuple[list[list[int]], list[int]]:
    """The serving requests, the same in every worker: random prompt ids and max_new_tokens from SERVING_SEED."""
    import numpy as np

    rng = np.random.default_rng(SERVING_SEED)
    (plo, phi), (olo, ohi) = args.serving_prompt_lens, args.serving_output_lens
    prompt_lens = rng.integers(plo, phi + 1, args.serving_requests)
    output_lens = rng.integers(olo, ohi + 1, args.serving_requests)
    return [rng.integers(0, vocab_size, n).tolist() for n in prompt_lens], output_lens.tolist()


def whole_pages(positions: int) -> int:
    """A KV pool size for npqwen.Engine: positions rounded up to whole pages."""
    from npqwen.engine.engine import DEFAULT_PAGE_SIZE as P

    return -(-positions // P) * P


def serving_kv_tokens(args) -> int:
    """The default KV pool of the serving run: every request at its longest, all at once, so it never preempts."""
    return args.serving_requests * whole_pages(args.serving_prompt_lens[1] + args.serving_output_lens[1])


def add_fixed(engine, ids, max_new_tokens):
    """Queue a greedy request that runs to exactly max_new_tokens: its eos ids are cleared (a random
    model samples eos whenever it likes), so every engine does the same work. The Request."""
    rid = engine.add_request(ids, max_new_tokens=max_new_tokens, temperature=0)
    req = engine.requests[rid]
    req.eos_ids = frozenset()
    return req


def run_to_end(engine) -> int:
    """Step the engine until every request is done; the number of steps."""
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def warm_up(engine):
    """One short request first, so no timed run pays for first calls (it fills no page: nothing is cached)."""
    add_fixed(engine, list(range(16)), 2)
    run_to_end(engine)


def serve_all_at_once(engine, prompts, outputs) -> dict:
    """npqwen's engine: every request added at time 0, then steps until all are done."""
    warm_up(engine)
    start = time.perf_counter()
    reqs = [add_fixed(engine, ids, n) for ids, n in zip(prompts, outputs)]
    steps = run_to_end(engine)
    end = time.perf_counter()
    records = [(len(r.prompt_ids), len(r.output_ids), r.token_times) for r in reqs]
    return {**serving_summary(records, start, end), "steps": steps, "preemptions": engine.stats["preemptions"]}


def serve_one_by_one(llm, prompts, outputs) -> dict:
    """npqwen without batching: every request arrives at time 0, each runs alone through the engine
    after the one before it has finished (so its time to first token includes that wait)."""
    from npqwen import Engine

    engine = Engine(llm, kv_cache_tokens=whole_pages(max(len(ids) + n for ids, n in zip(prompts, outputs))))
    warm_up(engine)
    start, reqs = time.perf_counter(), []
    for ids, n in zip(prompts, outputs):
        reqs.append(add_fixed(engine, ids, n))
        run_to_end(engine)
    end = time.perf_counter()
    return serving_summary([(len(r.prompt_ids), len(r.output_ids), r.token_times) for r in reqs], start, end)


def serving_summary(records, start, end) -> dict:
    """Totals, rates and latencies of one serving run. records: (prompt tokens, output tokens counted,
    the time each counted token was sampled) per request; all requests arrived at `start`.
    TTFT = first token - start; TPOT = (last token - first token) / (output tokens - 1), per request."""
    import numpy as np

    ttft = [times[0] - start for _, _, times in records]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for _, _, times in records if len(times) > 1]
    prompt, output, total = sum(r[0] for r in records), sum(r[1] for r in records), end - start
    stats = {"requests": len(records), "prompt_tokens": prompt, "output_tokens": output, "total_s": total,
             "output_tps": output / total, "total_tps": (prompt + output) / total,
             "ttft_mean_s": float(np.mean(ttft)), "ttft_p99_s": float(np.percentile(ttft, 99))}
    if tpot:
        stats.update(tpot_mean_s=float(np.mean(tpot)), tpot_p99_s=float(np.percentile(tpot, 99)))
    return stats


def prefix_case(llm, args) -> dict:
    """Requests that share a long system prompt, run one at a time: the first finds the prefix cache
    empty (cold); the later ones find the system prompt's full pages cached and compute only the
    rest. Time to first token of each, from its own arrival."""
    import numpy as np

    from npqwen import Engine

    rng = np.random.default_rng(SERVING_SEED + 1)
    V = llm.config.vocab_size
    system = rng.integers(0, V, args.prefix_tokens).tolist()
    prompts = [system + rng.integers(0, V, PREFIX_SUFFIX_TOKENS).tolist() for _ in range(args.prefix_requests)]
    # room for one request's pages plus the cached prefix pages beside them
    engine = Engine(llm, kv_cache_tokens=2 * whole_pages(len(prompts[0]) + PREFIX_NEW_TOKENS))
    warm_up(engine)
    ttft = []
    for ids in prompts:
        req = add_fixed(engine, ids, PREFIX_NEW_TOKENS)
        run_to_end(engine)
        ttft.append(req.token_times[0] - req.arrival)
    return {"requests": len(prompts), "prefix_tokens": args.prefix_tokens, "suffix_tokens": PREFIX_SUFFIX_TOKENS,
            "new_tokens": PREFIX_NEW_TOKENS, "page_size": engine.page_size, "cold_ttft_s": ttft[0],
            "cached_ttft_mean_s": sum(ttft[1:]) / len(ttft[1:]) if len(ttft) > 1 else None,
            "cache_hit_tokens": engine.stats["prefix_cache_hit_tokens"]}


def run_serving(model: Path, args, engines) -> dict:
    """The serving and prefix suites: one worker per engine, run once; their results gathered."""
    (plo, phi), (olo, ohi) = args.serving_prompt_lens, args.serving_output_lens
    out = {"workload": {"requests": args.serving_requests, "sample": args.serving_sample,
                        "prompt_lens": [plo, phi], "output_lens": [olo, ohi], "hf_batch": args.serving_batch,
                        "seed": SERVING_SEED},
           "runs": {}, "errors": {}}
    for engine in engines:
        suites = [s for s in SERVING_SUITES if s in args.suites]
        if engine != "npqwen":    # HF has only the static-batch baseline
            suites = [s for s in suites if s == "serving" and args.serving_sample]
        if not suites:
            continue
        print(f"[bench] {'/'.join(suites)}: {engine} ...", file=sys.stderr, flush=True)
        result = spawn_worker(engine, model, args, suites)
        if "error" in result:
            out["errors"][engine] = result["error"]
            continue
        out["runs"].update(result.get("serving", {}))
        for key in ("memory", "prefix", "machine"):
            if key in result:
                out[key] = result[key]
    return out


# ---------------------------------------------------------------------------- figures and tables

def figures(report) -> dict:
    """Ratios and bounds from the raw measurements."""
    f = single_figures(report)
    if "serving" in report:
        f.update(serving_figures(report))
    return f


def single_figures(report) -> dict:
    """The figures of the prefill, decode and batch1 suites."""
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
    # batch1: the engine's step for its one running request, as a % of the single-sequence decode step
    if dec and f"batch1_{dec[0]}_tps" in ours:
        f["batch1_short_pct_of_decode"] = 100 * ours[f"batch1_{dec[0]}_tps"] / ours[short]
    if dec and long != short and f"batch1_{dec[-1]}_tps" in ours:
        f["batch1_long_pct_of_decode"] = 100 * ours[f"batch1_{dec[-1]}_tps"] / ours[long]
    if "kv_cache_bytes" in ours and "step_batch_s" not in ours:   # the step suite's KV pool is in its RSS
        f["rss_over_weights_plus_kv"] = ours["peak_rss_bytes"] / (ours["weight_bytes"] + ours["kv_cache_bytes"])
    for step in ("prefill", "batch"):   # the step suite: linear layers alone / the whole step
        if f"step_{step}_s" in ours:
            f[f"step_{step}_pct_of_matmul"] = 100 * ours[f"step_{step}_matmul_s"] / ours[f"step_{step}_s"]
            for peer in ("hf-bfloat16", "hf-float32"):
                if f"step_{step}_s" in e.get(peer, {}):
                    f[f"step_{step}_vs_{peer}"] = e[peer][f"step_{step}_s"] / ours[f"step_{step}_s"]
    return f


def serving_figures(report) -> dict:
    """The serving and prefix suites' figures: the engine against the baselines (output tokens/s),
    against the linear-layer bound, its memory, and the prefix cache's effect on time to first token."""
    s, m, f = report["serving"], report["machine"], {}
    runs = s["runs"]
    ours = runs.get("npqwen-engine")
    if ours:
        for name, run in runs.items():
            if name != "npqwen-engine":
                f[f"serving_output_tps_vs_{name}"] = ours["output_tps"] / run["output_tps"]
        if "matmul_GFLOPs" in m:
            # Every token goes through the linear layers once, except each request's last sampled
            # token, which is never fed back; every sampled token needs its lm_head row.
            tokens = ours["prompt_tokens"] + ours["output_tokens"] - ours["requests"]
            f["serving_linear_flops"] = linear_flops(report["checkpoint"], tokens, ours["output_tokens"])
            f["serving_linear_bound_s"] = f["serving_linear_flops"] / (m["matmul_GFLOPs"] * 1e9)
            f["serving_pct_of_linear_bound"] = 100 * f["serving_linear_bound_s"] / ours["total_s"]
    mem = s.get("memory")
    if mem:
        f["serving_rss_over_weights_plus_kv_pool"] = \
            mem["peak_rss_bytes"] / (mem["weight_bytes"] + mem["kv_pool_bytes"])
    prefix = s.get("prefix")
    if prefix and prefix["cached_ttft_mean_s"]:
        f["prefix_cold_over_cached_ttft"] = prefix["cold_ttft_s"] / prefix["cached_ttft_mean_s"]
    return f


def linear_params_per_token(c) -> int:
    """Weights each token multiplies in the layers: q/k/v/o and gate/up/down of every layer."""
    D, F, H, K, Dh = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    return c.num_hidden_layers * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F)


def prefill_flops(checkpoint, T) -> float:
    """Multiply-adds x 2 of a T-token prefill: every layer's matmuls, causal attention, one lm_head row."""
    from npqwen.config import Qwen3Config

    c = Qwen3Config.from_json(Path(checkpoint) / "config.json")
    H, Dh = c.num_attention_heads, c.head_dim
    attention = c.num_hidden_layers * H * Dh * 2 * (T * (T + 1) / 2)   # q k^T and p v over the causal triangle
    return 2 * (linear_params_per_token(c) * T + attention + c.hidden_size * c.vocab_size)


def linear_flops(checkpoint, tokens, sampled) -> float:
    """Multiply-adds x 2 of the linear layers alone: `tokens` through every layer, `sampled` lm_head rows
    (attention is left out, so the time these take at the float32 matmul rate is a lower bound)."""
    from npqwen.config import Qwen3Config

    c = Qwen3Config.from_json(Path(checkpoint) / "config.json")
    return 2 * (linear_params_per_token(c) * tokens + c.hidden_size * c.vocab_size * sampled)


TARGETS = [  # (figure, comparison, threshold, label)
    ("decode_vs_hf-bfloat16", ">=", 1.1, "decode (short prompt) vs HF bfloat16"),
    ("decode_vs_hf-float32", ">=", 1.8, "decode (short prompt) vs HF float32"),
    ("decode_pct_of_bound", ">=", 85, "decode, % of the bandwidth bound"),
    ("long_over_short_decode_pct", ">=", 70, "decode after the long prompt, % of short"),
    ("prefill_1024_vs_hf-float32", ">=", 1.1, "prefill 1024 vs HF float32"),
    ("prefill_1024_pct_of_matmul", ">=", 75, "prefill 1024, % of float32 matmul throughput"),
    ("rss_over_weights_plus_kv", "<=", 1.2, "peak RSS / (float32 weights + KV cache)"),
    ("batch1_short_pct_of_decode", ">=", 95, "engine, batch of one: decode after the short prompt, % of single"),
    ("batch1_long_pct_of_decode", ">=", 90, "engine, batch of one: decode after the long prompt, % of single"),
    ("serving_pct_of_linear_bound", ">=", 50, "serving: linear-layer bound / engine's time"),
    ("serving_rss_over_weights_plus_kv_pool", "<=", 1.15, "serving: peak RSS / (weights + KV pool)"),
    ("step_prefill_pct_of_matmul", ">=", 75, "prefill step: its linear layers alone, % of the step"),
    ("step_batch_pct_of_matmul", ">=", 75, "batched decode step: its linear layers alone, % of the step"),
    ("step_prefill_vs_hf-float32", ">=", 0, "prefill step vs HF float32 (time ratio)"),
    ("step_prefill_vs_hf-bfloat16", ">=", 0, "prefill step vs HF bfloat16 (time ratio)"),
    ("step_batch_vs_hf-float32", ">=", 0, "batched decode step vs HF float32 (time ratio)"),
    ("step_batch_vs_hf-bfloat16", ">=", 0, "batched decode step vs HF bfloat16 (time ratio)"),
]


KINDS = {"decode": "decode", "batch1": "engine decode", "prefill": "prefill"}   # row order and label of *_N_tps
STEP_ROWS = {"step_prefill_s": "prefill step (s)", "step_prefill_matmul_s": "  its linear layers alone (s)",
             "step_batch_s": "batched decode step (s)", "step_batch_matmul_s": "  its linear layers alone (s)"}


def rows(report):
    e = report["engines"]
    names = list(e)
    keys = ["load_s"] + sorted({k for v in e.values() for k in v if k.endswith("_tps")},
                               key=lambda k: (list(KINDS).index(k.split("_")[0]), int(k.split("_")[1]))) + \
        [k for k in STEP_ROWS if any(k in v for v in e.values())] + ["peak_rss_bytes"]
    out = []
    for k in keys:
        label = {"load_s": "load (s)", "peak_rss_bytes": "peak RSS (GB)", **STEP_ROWS}.get(k) or \
            f"{KINDS[k.split('_')[0]]} tok/s ({k.split('_')[1]}-token prompt)"
        cells = []
        for n in names:
            v = e[n].get(k)
            cells.append("-" if v is None else f"{v / 1e9:.2f}" if k == "peak_rss_bytes" else f"{v:.2f}"
                         if k == "load_s" else f"{v:.3f}" if k in STEP_ROWS else f"{v:.1f}")
        out.append((label, cells))
    return names, out


SERVING_ROWS = [  # (key, label, scale, decimals)
    ("requests", "requests run", 1, 0),
    ("total_s", "total time (s)", 1, 1),
    ("output_tps", "output tok/s", 1, 1),
    ("total_tps", "prompt + output tok/s", 1, 1),
    ("ttft_mean_s", "time to first token, mean (s)", 1, 2),
    ("ttft_p99_s", "time to first token, p99 (s)", 1, 2),
    ("tpot_mean_s", "time per output token, mean (ms)", 1e3, 1),
    ("tpot_p99_s", "time per output token, p99 (ms)", 1e3, 1),
]


def serving_rows(report):
    """The serving table: one column per run (engine, one by one, HF static batches)."""
    runs, f = report["serving"]["runs"], report["figures"]
    names = list(runs)
    out = []
    for key, label, scale, decimals in SERVING_ROWS:
        out.append((label, ["-" if key not in runs[n] else f"{runs[n][key] * scale:.{decimals}f}" for n in names]))
    out.append(("engine's output tok/s / this", [f"{f[f'serving_output_tps_vs_{n}']:.2f}x"
                                                  if f"serving_output_tps_vs_{n}" in f else "-" for n in names]))
    return names, out


def serving_notes(report) -> list[str]:
    """What the serving and prefix runs were, in sentences: the workload, the sample, the bound, memory, prefix."""
    s, f, m = report["serving"], report["figures"], report["machine"]
    w, runs, notes = s["workload"], s["runs"], []
    R, N = w["requests"], w["sample"]
    baselines = (f"npqwen one by one through the engine; HF static batches of {w['hf_batch']}, left-padded, each "
                 f"running to its longest request")
    if not N:
        sample = "no baselines ran (--serving-sample 0)."
    elif N < R:
        sample = (f"the baselines ({baselines}) run only the first {N}, so compare their rates: their total time and "
                  f"time to first token cover those {N} requests only, and the other {R - N} would wait behind them.")
    else:
        sample = f"so do the baselines ({baselines})."
    if runs:
        notes.append(f"Serving: {R} requests arriving at once, prompts of {w['prompt_lens'][0]}-{w['prompt_lens'][1]} "
                     f"random tokens, max_new_tokens {w['output_lens'][0]}-{w['output_lens'][1]} (uniform, seed "
                     f"{w['seed']}), greedy, eos ignored. npqwen-engine runs all {R}; {sample}")
    if "serving_linear_bound_s" in f:
        e = runs["npqwen-engine"]
        notes.append(f"Linear-layer bound: {f['serving_linear_flops'] / 1e12:.2f} TFLOP (q/k/v/o/gate/up/down for "
                     f"{e['prompt_tokens'] + e['output_tokens'] - e['requests']} tokens, lm_head for "
                     f"{e['output_tokens']}) at {m['matmul_GFLOPs']:.0f} GFLOP/s = "
                     f"{f['serving_linear_bound_s']:.1f} s; "
                     f"the engine took {e['total_s']:.1f} s ({f['serving_pct_of_linear_bound']:.0f}%, "
                     f"{e['steps']} steps, {e['preemptions']} preemptions).")
    if "memory" in s:
        mem = s["memory"]
        notes.append(f"Memory: KV pool of {mem['kv_cache_tokens']} positions = {mem['kv_pool_bytes'] / 1e9:.2f} GB "
                     f"(allocated up front, touched as used), weights {mem['weight_bytes'] / 1e9:.2f} GB, peak RSS "
                     f"{mem['peak_rss_bytes'] / 1e9:.2f} GB after the engine's run "
                     f"({f['serving_rss_over_weights_plus_kv_pool']:.2f}x their sum).")
    if "prefix" in s:
        p = s["prefix"]
        cached = (f"{p['cached_ttft_mean_s']:.3f} s for the {p['requests'] - 1} after it (mean), "
                  f"{f['prefix_cold_over_cached_ttft']:.1f}x faster" if "prefix_cold_over_cached_ttft" in f
                  else "no later request")
        notes.append(f"Prefix cache: {p['requests']} requests share a {p['prefix_tokens']}-token system prompt plus "
                     f"{p['suffix_tokens']} tokens of their own, {p['new_tokens']} new tokens, run one at a time: "
                     f"time to first token {p['cold_ttft_s']:.3f} s for the first (cache empty), {cached}; "
                     f"{p['cache_hit_tokens']} prompt tokens came from the cache (whole pages of "
                     f"{p['page_size']}).")
    notes += [f"{engine} (serving): {error}" for engine, error in s["errors"].items()]
    return notes


def target_lines(report):
    f = report["figures"]
    lines = []
    for key, op, threshold, label in TARGETS:
        if key in f:
            ok = f[key] >= threshold if op == ">=" else f[key] <= threshold
            unit = "x" if "vs" in key or "over_weights" in key else "%"
            if threshold == 0:   # reported, no target
                lines.append((label, f"{f[key]:.2f}{unit}", "", ""))
                continue
            lines.append((label, f"{f[key]:.2f}{unit}" if unit == "x" else f"{f[key]:.0f}%",
                          f"{op} {threshold}{unit}", "yes" if ok else "NO"))
    return lines


def machine_line(m, sep=", ") -> str:
    measured = ([f"streaming read {m['bandwidth_GBps']:.1f} GB/s"] if "bandwidth_GBps" in m else []) + \
        ([f"float32 matmul {m['matmul_GFLOPs']:.0f} GFLOP/s"] if "matmul_GFLOPs" in m else [])
    return sep.join(measured)


def text_table(names, body, width=12) -> list[str]:
    label_width = max(len(r[0]) for r in body)
    lines = [" " * label_width + "  " + "  ".join(f"{n:>{width}}" for n in names)]
    lines += [f"{label:<{label_width}}  " + "  ".join(f"{c:>{width}}" for c in cells) for label, cells in body]
    return lines


def table(report) -> str:
    m = report["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, numpy {m['numpy']}"]
    if machine_line(m):
        lines.append(f"measured: {machine_line(m)}")
    lines.append(f"checkpoint: {report['checkpoint']}")
    if report["engines"]:
        names, body = rows(report)
        lines += [""] + text_table(names, body)
        for n in names:
            if "error" in report["engines"][n]:
                lines.append(f"{n}: {report['engines'][n]['error']}")
    f = report["figures"]
    if "decode_bound_tps" in f:
        lines.append(f"\ndecode bound: {f['decode_bound_tps']:.1f} tok/s (weights read per token / bandwidth)")
    if report.get("serving", {}).get("runs"):
        names, body = serving_rows(report)
        lines += [""] + text_table(names, body, width=18)
    if "serving" in report:
        lines += [""] + serving_notes(report)
    targets = target_lines(report)
    if targets:
        width = max(len(t[0]) for t in targets)
        lines.append(f"\n{'target':<{width}}  {'measured':>8}  {'target':>8}   met")
        for label, value, target, ok in targets:
            lines.append(f"{label:<{width}}  {value:>8}  {target:>8}   {ok}")
    return "\n".join(lines)


def markdown_table(names, body) -> list[str]:
    return ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)] + \
        [f"| {label} | " + " | ".join(cells) + " |" for label, cells in body]


def markdown(report) -> str:
    m = report["machine"]
    out = [f"Machine: {m['cpu']}, {m['cores']} cores, BLAS/torch threads {m['threads']}, numpy {m['numpy']}, "
           f"Python {m['python']}." + (f" Measured on the spot: {machine_line(m)}." if machine_line(m) else "")]
    if report["engines"]:
        out += [""] + markdown_table(*rows(report))
    if report.get("serving", {}).get("runs"):
        out += [""] + markdown_table(*serving_rows(report))
    for note in serving_notes(report) if "serving" in report else []:
        out += ["", note]
    targets = target_lines(report)
    if targets:
        out += ["", "| target | measured | wanted | met |", "|---|---:|---:|---|"]
        out += [f"| {label} | {value} | {target} | {ok} |" for label, value, target, ok in targets]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
