"""prefill: tokens/s of one sequence's prefill of each --prefill prompt (the best of --repeats runs),
against the peers and the measured float32 matmul rate."""
from tools.bench.decode import lengths
from tools.bench.engines import PEERS
from tools.bench.machine import best_time, prefill_flops
from tools.bench.tables import rate_rows

NAME, WORKER, NEEDS = "prefill", "single", ()

TARGETS = [  # (figure, comparison, threshold, label)
    ("prefill_1024_vs_hf-float32", ">=", 1.1, "prefill 1024 vs HF float32"),
    ("prefill_1024_vs_hf-float16", ">=", 0, "prefill 1024 vs HF float16"),
    ("prefill_1024_pct_of_matmul", ">=", 75, "prefill 1024, % of float32 matmul throughput"),
]


def add_arguments(p):
    p.add_argument("--prefill", default="128,1024", type=lengths, help="prompt lengths for prefill tokens/s")


def runs_on(engine, args) -> bool:
    return True


def run(engine, args, rng) -> dict:
    out = {}
    for n in args.prefill:
        ids = rng.integers(0, engine.vocab_size, n).tolist()
        out[f"prefill_{n}_tps"] = n / best_time(lambda: engine.prefill(ids, capacity=n), args.repeats)
    return out


def figures(report) -> dict:
    """The longest prompt's prefill against the peers, and its FLOP rate against the matmul rate."""
    m, e, f = report["machine"], report["engines"], {}
    ours = e.get("npqwen", {})
    pre = sorted(int(k.split("_")[1]) for k in ours if k.startswith("prefill_"))
    if not pre:
        return f
    T = pre[-1]
    for peer in PEERS:
        if f"prefill_{T}_tps" in e.get(peer, {}):
            f[f"prefill_{T}_vs_{peer}"] = ours[f"prefill_{T}_tps"] / e[peer][f"prefill_{T}_tps"]
    if "matmul_GFLOPs" in m:
        f[f"prefill_{T}_GFLOPs"] = prefill_flops(report["checkpoint"], T) * ours[f"prefill_{T}_tps"] / T / 1e9
        f[f"prefill_{T}_pct_of_matmul"] = 100 * f[f"prefill_{T}_GFLOPs"] / m["matmul_GFLOPs"]
    return f


def rows(report) -> list:
    return rate_rows(report, "prefill", "prefill")


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    return []
