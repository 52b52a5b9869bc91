"""batch1: the decode suite's decode again, as a batch of one through npqwen.Engine (the step time of
its one running request), as a % of the one-sequence figure; implies decode."""
import time

from tools.bench.engines import add_fixed, decode_rate, whole_pages
from tools.bench.tables import rate_rows

NAME, WORKER, NEEDS = "batch1", "single", ("decode",)   # a % of the one-sequence decode, measured beside it

TARGETS = [  # (figure, comparison, threshold, label)
    ("batch1_short_pct_of_decode", ">=", 95, "engine, batch of one: decode after the short prompt, % of single"),
    ("batch1_long_pct_of_decode", ">=", 90, "engine, batch of one: decode after the long prompt, % of single"),
]


def add_arguments(p):
    pass   # it decodes the decode suite's prompts: --decode-prompts, --new-tokens


def runs_on(engine, args) -> bool:
    return engine == "npqwen"


def run(engine, args, rng) -> dict:
    return {}   # decode.run measures it on each of its prompts, right after its own decode


def engine_decode(engine, ids, new_tokens) -> float:
    """The same decode as a batch of one through npqwen.Engine: 1 / the median step time once
    the request's first token is out (its steps from then on are decode steps)."""
    from npqwen import Engine

    llm_engine = Engine(engine.llm, kv_cache_tokens=whole_pages(len(ids) + new_tokens))
    req = add_fixed(llm_engine, ids, new_tokens)
    steps = []
    while llm_engine.has_unfinished():
        decoding = bool(req.output_ids)
        started = time.perf_counter()
        llm_engine.step()
        if decoding:
            steps.append(time.perf_counter() - started)
    return decode_rate(steps)


def figures(report) -> dict:
    """The engine's step for its one running request, as a % of the one-sequence decode step."""
    ours, f = report["engines"].get("npqwen", {}), {}
    dec = sorted(int(k.split("_")[1]) for k in ours if k.startswith("decode_"))
    if dec and f"batch1_{dec[0]}_tps" in ours:
        f["batch1_short_pct_of_decode"] = 100 * ours[f"batch1_{dec[0]}_tps"] / ours[f"decode_{dec[0]}_tps"]
    if dec and dec[-1] != dec[0] and f"batch1_{dec[-1]}_tps" in ours:
        f["batch1_long_pct_of_decode"] = 100 * ours[f"batch1_{dec[-1]}_tps"] / ours[f"decode_{dec[-1]}_tps"]
    return f


def rows(report) -> list:
    return rate_rows(report, "batch1", "engine decode")


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    return []
