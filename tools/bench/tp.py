"""tp: tensor parallelism, one process with --tp-size x 1 BLAS threads split over --tp-size ranks of 1
thread each (mpiexec), against one process with --tp-size threads: decode tokens/s of one sequence
after a 16-token prompt, and a --tp-prefill (1024) token prefill (chunks of 512); the time each rank
spent in collectives (its communication, waits for the other ranks included), and each rank's peak RSS.

Both sides run in processes of their own (`python -m tools.bench.tp`, one of them under mpiexec),
started from the npqwen worker, so each peak RSS is its own; the same prompts, the same code
(prefill / decode_one_token, which run on every rank).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

NAME, WORKER, NEEDS = "tp", "single", ()
ROOT = Path(__file__).resolve().parents[2]

TARGETS = [  # (figure, comparison, threshold, label)
    ("tp_decode_vs_one", ">=", 0.9, "decode batch-1, TP=2 (2 ranks x 1 thread) vs one process (2 threads)"),
    ("tp_prefill_vs_one", ">=", 0.9, "prefill (--tp-prefill tokens), TP=2 vs one process"),
    ("tp_rank_rss_vs_one", "<=", 0.6, "peak RSS of the larger rank vs one process"),
]


def add_arguments(p):
    p.add_argument("--tp-size", type=int, default=2, help="tp: ranks (and the one process's BLAS threads)")
    p.add_argument("--tp-prefill", type=int, default=1024, help="tp: prompt length of the prefill")
    p.add_argument("--tp-new-tokens", type=int, default=64, help="tp: tokens decoded after a 16-token prompt")


def runs_on(engine, args) -> bool:
    return engine == "npqwen" and args.device == "cpu"


def run(engine, args, rng) -> dict:
    """Both sides, one after the other, each in its own process(es); their figures, "tp_" before each."""
    n = args.tp_size
    common = ["--model", str(args.model), "--prefill", str(args.tp_prefill), "--new-tokens", str(args.tp_new_tokens),
              "--repeats", str(args.repeats)]
    one = side([sys.executable, "-m", "tools.bench.tp", *common], threads=n)
    from npqwen.cli.parallel import find_mpiexec
    split = side([find_mpiexec(), "-n", str(n), sys.executable, "-m", "tools.bench.tp", "--tp", *common], threads=1)
    return {**{f"tp_one_{k}": v for k, v in one.items()}, **{f"tp_split_{k}": v for k, v in split.items()}}


def side(command, threads: int) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(argv=None) -> dict:
    """In each process of one side: load, time decode and prefill; rank 0's figures and every rank's."""
    import numpy as np

    import npqwen
    from npqwen.generate import decode_one_token, prefill
    from tools.bench.engines import decode_rate
    from tools.bench.machine import best_time, peak_rss_bytes

    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--tp", action="store_true")
    p.add_argument("--prefill", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--repeats", type=int)
    args = p.parse_args(argv)
    started = time.perf_counter()
    llm = npqwen.load(args.model, tensor_parallel=args.tp)
    load_s = time.perf_counter() - started
    comm, model, rng = llm.comm, llm.model, np.random.default_rng(0)
    ids = rng.integers(0, llm.config.vocab_size, 16).tolist()
    long = rng.integers(0, llm.config.vocab_size, args.prefill).tolist()
    prefill(model, ids, model.new_cache(16))                                      # warm-up

    waited = lambda: getattr(comm, "seconds_waited", 0.0)                         # noqa: E731
    cache = model.new_cache(16 + args.new_tokens)
    token = int(prefill(model, ids, cache).argmax())
    steps, comm_before = [], waited()
    for _ in range(args.new_tokens - 1):
        t = time.perf_counter()
        token = int(decode_one_token(model, token, cache).argmax())
        steps.append(time.perf_counter() - t)
    decode_comm = (waited() - comm_before) / sum(steps)
    comm_before, t = waited(), time.perf_counter()
    prefill_s = best_time(lambda: prefill(model, long, model.new_cache(args.prefill)), args.repeats)
    prefill_comm = (waited() - comm_before) / (time.perf_counter() - t)
    mine = np.array([peak_rss_bytes(), decode_comm, prefill_comm], dtype=np.float64)
    every = comm.all_gather(mine[None, :]).reshape(-1, 3) if comm.size > 1 else mine[None, :]   # (ranks, 3)
    return {"ranks": comm.size, "load_s": load_s, "decode_tps": decode_rate(steps),
            "prefill_tps": args.prefill / prefill_s, "prefill_tokens": args.prefill, "rank_peak_rss_bytes": every[:, 0].tolist(),
            "rank_decode_comm_share": every[:, 1].tolist(), "rank_prefill_comm_share": every[:, 2].tolist(),
            "rank": comm.rank}


def figures(report) -> dict:
    ours, f = report["engines"].get("npqwen", {}), {}
    if "tp_split_decode_tps" not in ours or "tp_one_decode_tps" not in ours:
        return f
    f["tp_decode_vs_one"] = ours["tp_split_decode_tps"] / ours["tp_one_decode_tps"]
    f["tp_prefill_vs_one"] = ours["tp_split_prefill_tps"] / ours["tp_one_prefill_tps"]
    f["tp_rank_rss_vs_one"] = max(ours["tp_split_rank_peak_rss_bytes"]) / ours["tp_one_rank_peak_rss_bytes"][0]
    return f


def rows(report) -> list:
    return []


def tables(report) -> list:
    ours = report["engines"].get("npqwen", {})
    if "tp_split_decode_tps" not in ours:
        return [(["tp"], [("error", [ours.get("tp_split_error") or ours.get("tp_one_error") or "not run"])])] \
            if any(k.startswith("tp_") for k in ours) else []
    n = ours["tp_split_ranks"]
    names = [f"1 process x {n} threads", f"{n} ranks x 1 thread"]
    share = lambda key: " / ".join(f"{100 * s:.0f}%" for s in ours[key])          # noqa: E731
    body = [("decode tok/s (16-token prompt)", [f"{ours['tp_one_decode_tps']:.1f}", f"{ours['tp_split_decode_tps']:.1f}"]),
            (f"prefill tok/s ({ours['tp_one_prefill_tokens']}-token prompt)",
             [f"{ours['tp_one_prefill_tps']:.1f}", f"{ours['tp_split_prefill_tps']:.1f}"]),
            ("time in collectives, decode (per rank)", ["-", share("tp_split_rank_decode_comm_share")]),
            ("time in collectives, prefill (per rank)", ["-", share("tp_split_rank_prefill_comm_share")]),
            ("peak RSS per rank (GB)", [f"{ours['tp_one_rank_peak_rss_bytes'][0] / 1e9:.2f}",
                                         " / ".join(f"{b / 1e9:.2f}" for b in ours["tp_split_rank_peak_rss_bytes"])]),
            ("load (s)", [f"{ours['tp_one_load_s']:.2f}", f"{ours['tp_split_load_s']:.2f}"])]
    return [(names, body)]


def notes(report) -> list[str]:
    return []


if __name__ == "__main__":   # one side's process (or one rank of it): its figures as one JSON line, from rank 0
    figures_ = measure()
    if figures_.pop("rank") == 0:
        print(json.dumps(figures_))
