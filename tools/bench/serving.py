"""serving: many requests arriving at once, through npqwen's engine (all of them) and the baselines
(npqwen one request after another, HF static batches: the first --serving-sample only); output
tokens/s, time to first token, time per output token, the linear-layer bound, and memory."""
import argparse
import time

from tools.bench.engines import add_fixed, run_to_end, warm_up, whole_pages
from tools.bench.machine import linear_flops, measure_device, measure_matmul, peak_rss_bytes

NAME, WORKER, NEEDS = "serving", "serving", ()
SEED = 0   # the serving workload is fixed: the same requests in every worker and run

TARGETS = [  # (figure, comparison, threshold, label)
    ("serving_pct_of_linear_bound", ">=", 50, "serving: linear-layer bound / engine's time"),
    ("serving_rss_over_weights_plus_kv_pool", "<=", 1.15, "serving: peak RSS / (weights + KV pool)"),
]

ROWS = [  # (key, label, scale, decimals)
    ("requests", "requests run", 1, 0),
    ("total_s", "total time (s)", 1, 1),
    ("output_tps", "output tok/s", 1, 1),
    ("total_tps", "prompt + output tok/s", 1, 1),
    ("ttft_mean_s", "time to first token, mean (s)", 1, 2),
    ("ttft_p99_s", "time to first token, p99 (s)", 1, 2),
    ("tpot_mean_s", "time per output token, mean (ms)", 1e3, 1),
    ("tpot_p99_s", "time per output token, p99 (ms)", 1e3, 1),
]


def add_arguments(p):
    p.add_argument("--serving-requests", type=at_least_1, default=64,
                   help="serving: requests arriving at once; npqwen's engine runs them all")
    p.add_argument("--serving-sample", type=int, default=16,
                   help="serving: the baselines (npqwen one by one, HF static batches) run only the first N "
                        "requests and report rates from them; 0 skips them")
    p.add_argument("--serving-prompt-lens", default="32-512", type=length_range,
                   help="serving: prompt lengths, uniform in MIN-MAX")
    p.add_argument("--serving-output-lens", default="16-256", type=length_range,
                   help="serving: max_new_tokens, uniform in MIN-MAX (eos is ignored: each runs to its own)")
    p.add_argument("--serving-batch", type=at_least_1, default=16, help="serving: HF static batch size")
    p.add_argument("--serving-kv-tokens", type=int,
                   help="serving: npqwen's KV pool in positions (default: every request at its longest at "
                        "once, in whole pages: 64 x 768 with the defaults)")


def at_least_1(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return int(text)


def length_range(text: str) -> tuple[int, int]:
    """"32-512" -> (32, 512); "64" -> (64, 64)."""
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"a length range is MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def sample(args) -> int:
    """How many of the requests the baselines run: --serving-sample, within 0..--serving-requests."""
    return max(0, min(args.serving_sample, args.serving_requests))


def runs_on(engine, args) -> bool:
    return engine == "npqwen" or sample(args) > 0   # HF has only the static-batch baseline


def workload(args) -> dict:
    """The workload, as the report describes it."""
    (plo, phi), (olo, ohi) = args.serving_prompt_lens, args.serving_output_lens
    return {"requests": args.serving_requests, "sample": sample(args), "prompt_lens": [plo, phi],
            "output_lens": [olo, ohi], "hf_batch": args.serving_batch, "seed": SEED}


def requests(args, vocab_size) -> tuple[list[list[int]], list[int]]:
    """The serving requests, the same in every worker: random prompt ids and max_new_tokens from SEED."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    (plo, phi), (olo, ohi) = args.serving_prompt_lens, args.serving_output_lens
    prompt_lens = rng.integers(plo, phi + 1, args.serving_requests)
    output_lens = rng.integers(olo, ohi + 1, args.serving_requests)
    return [rng.integers(0, vocab_size, n).tolist() for n in prompt_lens], output_lens.tolist()


def kv_tokens(args) -> int:
    """The default KV pool of the serving run: every request at its longest, all at once, so it never preempts."""
    return args.serving_requests * whole_pages(args.serving_prompt_lens[1] + args.serving_output_lens[1])


def run(engine, args, rng) -> dict:
    """npqwen: the workload through the engine (all at once), then one request after another (the
    first --serving-sample only); HF: the first --serving-sample requests in static batches."""
    prompts, outputs = requests(args, engine.vocab_size)
    N = sample(args)
    if engine.name != "npqwen":
        return {"serving": {f"{engine.name}-static": serve_static(engine, prompts[:N], outputs[:N],
                                                                  args.serving_batch)}}
    from npqwen import Engine

    llm, out = engine.llm, {"serving": {}}
    on_cpu = args.device == "cpu"
    matmul = measure_matmul(llm.weights) if on_cpu else None   # for the linear-layer bound
    pool = args.serving_kv_tokens or kv_tokens(args)
    llm_engine = Engine(llm, kv_cache_tokens=pool)
    out["serving"]["npqwen-engine"] = serve_all_at_once(llm_engine, prompts, outputs)
    # Peak RSS now, before anything else runs in this process: the weights, the KV pool's
    # pages that were touched, and the engine's activations.
    out["memory"] = {"peak_rss_bytes": peak_rss_bytes(), "weight_bytes": engine.sizes["weight_bytes"],
                     "kv_pool_bytes": llm_engine.kv.nbytes, "kv_cache_tokens": pool}
    del llm_engine
    if N:
        out["serving"]["npqwen-sequential"] = serve_one_by_one(llm, prompts[:N], outputs[:N])
    if on_cpu:
        out["machine"] = {"matmul_GFLOPs": max(matmul, measure_matmul(llm.weights))}
    else:   # the GPU's own matrix rate, for the bound
        out["machine"] = measure_device(llm.model.xp, llm.model.dtype)
    return out


def serve_all_at_once(engine, prompts, outputs) -> dict:
    """npqwen's engine: every request added at time 0, then steps until all are done."""
    warm_up(engine)
    start = time.perf_counter()
    reqs = [add_fixed(engine, ids, n) for ids, n in zip(prompts, outputs)]
    steps = run_to_end(engine)
    end = time.perf_counter()
    records = [(len(r.prompt_ids), len(r.output_ids), r.token_times) for r in reqs]
    return {**summary(records, start, end), "steps": steps, "preemptions": engine.stats["preemptions"]}


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
    return summary([(len(r.prompt_ids), len(r.output_ids), r.token_times) for r in reqs], start, end)


def serve_static(engine, prompts, outputs, batch_size) -> dict:
    """HF static batching: batches of batch_size in arrival order, left-padded (masked), each one
    generating greedily until its longest request is done; the next batch starts after it.
    A request counts its own max_new_tokens only, so padding and the tokens generated past
    its own length are work done but not counted."""
    torch = engine.torch
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
            engine.model.generate(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device),
                                  max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                  pad_token_id=0, streamer=clock)
        return clock.times                                              # one time per generated step

    generate([(prompts[0][:8], 2)] * 2)   # warm-up
    start, records = time.perf_counter(), []
    for b in range(0, len(prompts), batch_size):
        group = list(zip(prompts[b:b + batch_size], outputs[b:b + batch_size]))
        times = generate(group)
        records += [(len(ids), n, times[:n]) for ids, n in group]
    return summary(records, start, time.perf_counter())


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


def summary(records, start, end) -> dict:
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


def figures(report) -> dict:
    """The engine against the baselines (output tokens/s), against the linear-layer bound, and its memory."""
    s, m, f = report.get("serving", {}), report["machine"], {}
    ours = s.get("runs", {}).get("npqwen-engine")
    if ours:
        for name, run_ in s["runs"].items():
            if name != "npqwen-engine":
                f[f"serving_output_tps_vs_{name}"] = ours["output_tps"] / run_["output_tps"]
        if "matmul_GFLOPs" in m:
            # Every token goes through the linear layers once, except each request's last sampled
            # token, which is never fed back; every sampled token needs its lm_head row.
            tokens = ours["prompt_tokens"] + ours["output_tokens"] - ours["requests"]
            f["serving_linear_flops"] = linear_flops(report["checkpoint"], tokens, ours["output_tokens"])
            f["serving_linear_bound_s"] = f["serving_linear_flops"] / (m["matmul_GFLOPs"] * 1e9)
            f["serving_pct_of_linear_bound"] = 100 * f["serving_linear_bound_s"] / ours["total_s"]
    mem = s.get("memory")
    if mem and m.get("device") != "cuda":   # on a GPU the weights and the pool are not in the host's RSS
        f["serving_rss_over_weights_plus_kv_pool"] = \
            mem["peak_rss_bytes"] / (mem["weight_bytes"] + mem["kv_pool_bytes"])
    return f


def rows(report) -> list:
    return []


def tables(report) -> list:
    """The serving table: one column per run (engine, one by one, HF static batches)."""
    runs, f = report.get("serving", {}).get("runs"), report["figures"]
    if not runs:
        return []
    names = list(runs)
    body = [(label, ["-" if key not in runs[n] else f"{runs[n][key] * scale:.{decimals}f}" for n in names])
            for key, label, scale, decimals in ROWS]
    body.append(("engine's output tok/s / this", [f"{f[f'serving_output_tps_vs_{n}']:.2f}x"
                                                   if f"serving_output_tps_vs_{n}" in f else "-" for n in names]))
    return [(names, body)]


def notes(report) -> list[str]:
    """What the serving run was, in sentences: the workload, the sample, the bound, memory."""
    s, f, m = report.get("serving", {}), report["figures"], report["machine"]
    runs, notes = s.get("runs"), []
    if runs:
        w = s["workload"]
        R, N = w["requests"], w["sample"]
        baselines = (f"npqwen one by one through the engine; HF static batches of {w['hf_batch']}, left-padded, "
                     f"each running to its longest request")
        if not N:
            sampled = "no baselines ran (--serving-sample 0)."
        elif N < R:
            sampled = (f"the baselines ({baselines}) run only the first {N}, so compare their rates: their total "
                       f"time and time to first token cover those {N} requests only, and the other {R - N} would "
                       f"wait behind them.")
        else:
            sampled = f"so do the baselines ({baselines})."
        notes.append(f"Serving: {R} requests arriving at once, prompts of {w['prompt_lens'][0]}-{w['prompt_lens'][1]} "
                     f"random tokens, max_new_tokens {w['output_lens'][0]}-{w['output_lens'][1]} (uniform, seed "
                     f"{w['seed']}), greedy, eos ignored. npqwen-engine runs all {R}; {sampled}")
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
                     f"{mem['peak_rss_bytes'] / 1e9:.2f} GB after the engine's run " +
                     (f"({f['serving_rss_over_weights_plus_kv_pool']:.2f}x their sum)."
                      if "serving_rss_over_weights_plus_kv_pool" in f else "(on the host: both are on the GPU)."))
    return notes
