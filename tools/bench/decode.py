"""decode: tokens/s of one sequence decoding greedily after each --decode-prompts prompt
(prefill, then decode_one_token), against the bandwidth bound and the peers."""
from tools.bench import batch1
from tools.bench.engines import PEERS
from tools.bench.tables import rate_rows

NAME, WORKER, NEEDS = "decode", "single", ()

TARGETS = [  # (figure, comparison, threshold, label)
    ("decode_vs_hf-bfloat16", ">=", 1.1, "decode (short prompt) vs HF bfloat16"),
    ("decode_vs_hf-float32", ">=", 1.8, "decode (short prompt) vs HF float32"),
    ("decode_vs_hf-float16", ">=", 0, "decode (short prompt) vs HF float16"),
    ("decode_pct_of_bound", ">=", 85, "decode, % of the bandwidth bound"),
    ("long_over_short_decode_pct", ">=", 70, "decode after the long prompt, % of short"),
    ("rss_over_weights_plus_kv", "<=", 1.2, "peak RSS / (float32 weights + KV cache)"),
]


def add_arguments(p):
    p.add_argument("--decode-prompts", default="16,2048", type=lengths, help="prompt lengths before decoding")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens decoded after each decode prompt")


def lengths(text: str) -> list[int]:
    """"128,1024" -> [128, 1024]."""
    return [int(n) for n in text.split(",") if n]


def runs_on(engine, args) -> bool:
    return True


def run(engine, args, rng) -> dict:
    out = {}
    for n in args.decode_prompts:
        ids = rng.integers(0, engine.vocab_size, n).tolist()
        out[f"decode_{n}_tps"] = engine.decode(ids, args.new_tokens)
        if "batch1" in args.suites and batch1.runs_on(engine.name, args):   # same prompt, right after: same conditions
            out[f"batch1_{n}_tps"] = batch1.engine_decode(engine, ids, args.new_tokens)
    out["kv_cache_bytes"] = engine.kv_bytes(max(args.decode_prompts) + args.new_tokens)
    return out


def figures(report) -> dict:
    m, e, f = report["machine"], report["engines"], {}
    ours = e.get("npqwen", {})
    dec = sorted(int(k.split("_")[1]) for k in ours if k.startswith("decode_"))
    if not dec or "error" in ours:
        return f
    short, long = f"decode_{dec[0]}_tps", f"decode_{dec[-1]}_tps"
    if "bandwidth_GBps" in m:
        f["decode_bound_tps"] = m["bandwidth_GBps"] * 1e9 / ours["weight_bytes"]
        f["decode_pct_of_bound"] = 100 * ours[short] / f["decode_bound_tps"]
    if long != short:
        f["long_over_short_decode_pct"] = 100 * ours[long] / ours[short]
    for peer in PEERS:
        if short in e.get(peer, {}):
            f[f"decode_vs_{peer}"] = ours[short] / e[peer][short]
    # (the step suite's KV pool would be in the same peak RSS; on a GPU the weights and the cache are not in it)
    if "step_batch_s" not in ours and m.get("device") != "cuda":
        f["rss_over_weights_plus_kv"] = ours["peak_rss_bytes"] / (ours["weight_bytes"] + ours["kv_cache_bytes"])
    return f


def rows(report) -> list:
    return rate_rows(report, "decode", "decode")


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    f = report["figures"]
    if "decode_bound_tps" not in f:
        return []
    return [f"decode bound: {f['decode_bound_tps']:.1f} tok/s (weights read per token / bandwidth)"]
