"""hybrid: Qwen3.5 at the Qwen3.5-0.8B text shape (random weights, its own checkpoint, built once): decode
tokens/s after a short and after a long --hybrid-prompts prompt (the linear layers' state does not grow, so
the long one should decode nearly as fast), and prefill tokens/s of a --hybrid-prefill prompt, against HF
float32 and bfloat16 (their torch forms of the delta rule: no flash-linear-attention on a CPU). Runs alone
(--suites hybrid)."""
from tools.bench.decode import lengths
from tools.bench.engines import PEERS
from tools.bench.machine import best_time
from tools.bench.tables import row

NAME, WORKER, NEEDS = "hybrid", "single", ()

TARGETS = [  # (figure, comparison, threshold, label)
    ("hybrid_decode_vs_hf-bfloat16", ">=", 1.0, "Qwen3.5 decode (short prompt) vs HF bfloat16"),
    ("hybrid_long_over_short_decode_pct", ">=", 85, "Qwen3.5 decode after the long prompt, % of short"),
    ("hybrid_prefill_vs_hf-float32", ">=", 1.0, "Qwen3.5 prefill vs HF float32"),
    ("hybrid_decode_vs_hf-float32", ">=", 0, "Qwen3.5 decode (short prompt) vs HF float32"),
]


def add_arguments(p):
    p.add_argument("--hybrid-prompts", default="16,4096", type=lengths, help="hybrid: prompt lengths before decoding")
    p.add_argument("--hybrid-new-tokens", type=int, default=32, help="hybrid: tokens decoded after each prompt")
    p.add_argument("--hybrid-prefill", type=int, default=1024, help="hybrid: prompt length for prefill tokens/s")


def runs_on(engine, args) -> bool:
    return True


def run(engine, args, rng) -> dict:
    out = {}
    for n in args.hybrid_prompts:
        out[f"hybrid_decode_{n}_tps"] = engine.decode(rng.integers(0, engine.vocab_size, n).tolist(),
                                                      args.hybrid_new_tokens)
    T = args.hybrid_prefill
    ids = rng.integers(0, engine.vocab_size, T).tolist()
    out[f"hybrid_prefill_{T}_tps"] = T / best_time(lambda: engine.prefill(ids, capacity=T), args.repeats)
    return out


def figures(report) -> dict:
    e, f = report["engines"], {}
    ours = e.get("npqwen", {})
    dec = sorted(int(k.split("_")[2]) for k in ours if k.startswith("hybrid_decode_"))
    pre = [k for k in ours if k.startswith("hybrid_prefill_")]
    if not dec or "error" in ours:
        return f
    short, long = f"hybrid_decode_{dec[0]}_tps", f"hybrid_decode_{dec[-1]}_tps"
    if long != short:
        f["hybrid_long_over_short_decode_pct"] = 100 * ours[long] / ours[short]
    for peer in PEERS:
        if short in e.get(peer, {}):
            f[f"hybrid_decode_vs_{peer}"] = ours[short] / e[peer][short]
        if pre and pre[0] in e.get(peer, {}):
            f[f"hybrid_prefill_vs_{peer}"] = ours[pre[0]] / e[peer][pre[0]]
    return f


def rows(report) -> list:
    keys = sorted({k for r in report["engines"].values() for k in r if k.startswith("hybrid_") and k.endswith("_tps")},
                  key=lambda k: (k.split("_")[1], int(k.split("_")[2])))
    return [row(report, k, f"Qwen3.5 {k.split('_')[1]} tok/s ({k.split('_')[2]}-token prompt)") for k in keys]


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    return []
