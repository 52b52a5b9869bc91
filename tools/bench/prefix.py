"""prefix: requests sharing a long system prompt, run one at a time through npqwen's engine: time to
first token with the prefix cache empty (the first) and with its pages cached (the rest)."""
from tools.bench.engines import add_fixed, run_to_end, warm_up, whole_pages
from tools.bench.serving import SEED, at_least_1

NAME, WORKER, NEEDS = "prefix", "serving", ()
SUFFIX_TOKENS, NEW_TOKENS = 32, 4   # each request's own tokens, tokens generated
TARGETS = []


def add_arguments(p):
    p.add_argument("--prefix-tokens", type=at_least_1, default=1024, help="prefix: the shared system prompt's length")
    p.add_argument("--prefix-requests", type=at_least_1, default=16,
                   help="prefix: requests sharing it, one at a time")


def runs_on(engine, args) -> bool:
    return engine == "npqwen"


def run(engine, args, rng) -> dict:
    """The first request finds the prefix cache empty (cold); the later ones find the system prompt's
    full pages cached and compute only the rest. Time to first token of each, from its own arrival."""
    import numpy as np

    from npqwen import Engine

    rng = np.random.default_rng(SEED + 1)   # fixed, as the serving workload is
    V = engine.vocab_size
    system = rng.integers(0, V, args.prefix_tokens).tolist()
    prompts = [system + rng.integers(0, V, SUFFIX_TOKENS).tolist() for _ in range(args.prefix_requests)]
    # room for one request's pages plus the cached prefix pages beside them
    llm_engine = Engine(engine.llm, kv_cache_tokens=2 * whole_pages(len(prompts[0]) + NEW_TOKENS))
    warm_up(llm_engine)
    ttft = []
    for ids in prompts:
        req = add_fixed(llm_engine, ids, NEW_TOKENS)
        run_to_end(llm_engine)
        ttft.append(req.token_times[0] - req.arrival)
    return {"prefix": {"requests": len(prompts), "prefix_tokens": args.prefix_tokens, "suffix_tokens": SUFFIX_TOKENS,
                       "new_tokens": NEW_TOKENS, "page_size": llm_engine.page_size, "cold_ttft_s": ttft[0],
                       "cached_ttft_mean_s": sum(ttft[1:]) / len(ttft[1:]) if len(ttft) > 1 else None,
                       "cache_hit_tokens": llm_engine.stats["prefix_cache_hit_tokens"]}}


def figures(report) -> dict:
    prefix = report.get("serving", {}).get("prefix")
    if prefix and prefix["cached_ttft_mean_s"]:
        return {"prefix_cold_over_cached_ttft": prefix["cold_ttft_s"] / prefix["cached_ttft_mean_s"]}
    return {}


def rows(report) -> list:
    return []


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    p, f = report.get("serving", {}).get("prefix"), report["figures"]
    if not p:
        return []
    cached = (f"{p['cached_ttft_mean_s']:.3f} s for the {p['requests'] - 1} after it (mean), "
              f"{f['prefix_cold_over_cached_ttft']:.1f}x faster" if "prefix_cold_over_cached_ttft" in f
              else "no later request")
    return [f"Prefix cache: {p['requests']} requests share a {p['prefix_tokens']}-token system prompt plus "
            f"{p['suffix_tokens']} tokens of their own, {p['new_tokens']} new tokens, run one at a time: "
            f"time to first token {p['cold_ttft_s']:.3f} s for the first (cache empty), {cached}; "
            f"{p['cache_hit_tokens']} prompt tokens came from the cache (whole pages of {p['page_size']})."]
