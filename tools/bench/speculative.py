"""speculative: what speculative decoding costs and gives (npqwen, on the given --model in its weight format).

Verify: one sequence with --spec-context cached positions runs 1 + k tokens in one forward pass (the
verification of k drafts) for k in --spec-ks; each time is the median of --spec-steps (every k in turn,
so a busy moment blurs them alike), reported as a ratio to k = 0 (a plain decode step). On a CPU in
float32 the ratio is the point: OpenBLAS packs the weights for any product of 2+ rows, so a 2-row step
costs far more than a 1-row one; compact weights widen each block once for all the rows.
Speedup: one greedy request of --spec-new-tokens tokens with drafts from an oracle (the model's own
greedy continuation, so every draft is kept), then with each draft replaced by a random token with
probability 20% and 40% (acceptance 80% and 60% per draft), against the same request without drafts:
tokens/s ratio (the four run side by side, a step of each in turn, --spec-repeats times, the median of
each), and the acceptance measured. Run it on a few layers of a real shape, in each weight format:

    python -m tools.bench.speculative                  # Qwen3-0.6B's shape, 4 layers, random weights, float32
    python -m tools.bench.speculative --shape 0.8b --weights float32,bfloat16,int8,q8_0,q4_k --json out.json
"""
import statistics
import sys
import time

NAME, WORKER, NEEDS = "speculative", "single", ()
TARGETS = [("spec_verify_2_vs_1", ">=", 0, "verify step of 1 + 1 tokens vs a 1-token step (time ratio)"),
           ("spec_verify_5_vs_1", ">=", 0, "verify step of 1 + 4 tokens vs a 1-token step (time ratio)"),
           ("spec_100_vs_plain", ">=", 0, "speculative (k=4) vs plain decode, oracle drafts, 100% kept (tok/s ratio)"),
           ("spec_80_vs_plain", ">=", 0, "... 80% of drafts right (tok/s ratio)"),
           ("spec_60_vs_plain", ">=", 0, "... 60% of drafts right (tok/s ratio)")]
ACCEPTANCE = (100, 80, 60)


def add_arguments(p):
    p.add_argument("--spec-context", type=int, default=256, help="speculative: cached positions of the sequence")
    p.add_argument("--spec-ks", default="1,2,4,8", help="speculative: drafts verified in one step, comma-separated")
    p.add_argument("--spec-k", type=int, default=4, help="speculative: drafts per step in the speedup runs")
    p.add_argument("--spec-steps", type=int, default=9, help="speculative: steps timed per verify figure (median)")
    p.add_argument("--spec-new-tokens", type=int, default=48, help="speculative: tokens generated per speedup run")
    p.add_argument("--spec-repeats", type=int, default=3, help="speculative: speedup runs of each kind (median)")


def runs_on(engine, args) -> bool:
    return engine == "npqwen"


def verify_times(llm, context: int, ks: list[int], steps: int) -> dict:
    """{n: median seconds of a forward pass of n = 1 + k new tokens after `context` cached positions}, k = 0
    and each of ks."""
    import numpy as np

    from npqwen.kv_cache import Batch

    model, rng = llm.model, np.random.default_rng(0)
    cache = model.new_cache(context + max(ks) + 1)
    cache.kv.keys.fill(0.01)   # (never-written zero pages would be read from the OS's zero page: too fast)
    cache.kv.values.fill(0.01)
    times = {n: [] for n in [1] + [1 + k for k in ks]}
    for _ in range(steps + 1):
        for n, kept in times.items():   # in turn, so a busy moment blurs every n alike
            batch = Batch(rng.integers(0, llm.config.vocab_size, n), [context], [n], [cache.page_table],
                          cache.kv.page_size, sample_rows=np.arange(n), verify=[n > 1])   # (Qwen3.5: states kept)
            started = time.perf_counter()
            model.forward_batch(batch, cache.kv)
            kept.append(time.perf_counter() - started)
    return {n: statistics.median(t[1:]) for n, t in times.items()}   # (the first round untimed: warm-up)


def speedups(llm, k: int, new_tokens: int, repeats: int = 1, seed: int = 0) -> dict:
    """Tokens/s of one greedy request with oracle drafts (ACCEPTANCE % of them right) and without. The four
    run side by side, a step of each in turn (so a busy moment slows them alike), `repeats` times; each
    figure is the median over the repeats of its decoding time (its steps after the first token)."""
    import numpy as np

    from npqwen import Engine

    prompt = np.random.default_rng(seed).integers(0, llm.config.vocab_size, 32).tolist()
    plain = llm.generate(prompt, max_new_tokens=new_tokens, temperature=0).token_ids   # the oracle's answer

    def oracle_of(accept: int):
        rng = np.random.default_rng(accept)

        def oracle(req):   # the continuation decoding without drafts gave, each token wrong with 1 - accept %
            if req.uncomputed != 1 or req.params.speculative is None:
                return []
            have = len(req.output_ids)
            drafts = plain[have:have + min(k, req.max_new_tokens - have - 1)]
            return [int(rng.integers(llm.config.vocab_size)) if rng.random() * 100 >= accept else t for t in drafts]
        return oracle

    tps = {kind: [] for kind in ("plain", *ACCEPTANCE)}
    out = {}
    for _ in range(repeats):
        engines, tokens, seconds = {}, {}, {}
        for kind in tps:
            engine = engines[kind] = Engine(llm, kv_cache_tokens=1024, page_size=256)
            if kind != "plain":
                engine.propose = oracle_of(kind)
            engine.add_request(prompt, max_new_tokens=new_tokens, temperature=0,
                               speculative=None if kind == "plain" else {"method": "ngram", "k": k})
            tokens[kind], seconds[kind] = [], 0.0
        while any(e.has_unfinished() for e in engines.values()):
            for kind, engine in engines.items():   # one step of each in turn
                if engine.has_unfinished():
                    started = time.perf_counter()
                    step = engine.step()
                    if tokens[kind]:   # decoding only: from the first token on
                        seconds[kind] += time.perf_counter() - started
                    tokens[kind] += [t for o in step for t in o.token_ids]
        for kind, engine in engines.items():
            assert tokens[kind] == plain, "speculative decoding changed the greedy output"
            tps[kind].append((len(tokens[kind]) - 1) / seconds[kind])
            if kind != "plain":
                out[f"spec_{kind}_kept_pct"] = 100 * engine.stats["spec_decode_num_accepted_tokens"] / \
                    max(1, engine.stats["spec_decode_num_draft_tokens"])
    return {**out, **{f"spec_{kind}_tps": statistics.median(t) for kind, t in tps.items()}}


def run(engine, args, rng) -> dict:
    times = verify_times(engine.llm, args.spec_context, ks_of(args.spec_ks), args.spec_steps)
    out = {f"spec_verify_{n}_s": t for n, t in times.items()}
    return {**out, **speedups(engine.llm, args.spec_k, args.spec_new_tokens, args.spec_repeats)}


def ks_of(text: str) -> list[int]:
    return [int(k) for k in text.split(",") if k]


def figures(report) -> dict:
    ours, f = report["engines"].get("npqwen", {}), {}
    if "spec_verify_1_s" in ours:
        for key in ours:
            if key.startswith("spec_verify_") and key != "spec_verify_1_s":
                n = key.split("_")[2]
                f[f"spec_verify_{n}_vs_1"] = ours[key] / ours["spec_verify_1_s"]
    for accept in ACCEPTANCE:
        if f"spec_{accept}_tps" in ours:
            f[f"spec_{accept}_vs_plain"] = ours[f"spec_{accept}_tps"] / ours["spec_plain_tps"]
    return f


def rows(report) -> list:
    from tools.bench.tables import row

    keys = sorted({k for r in report["engines"].values() for k in r if k.startswith("spec_")})
    return [row(report, k, k.replace("_", " "), "{:.4f}") for k in keys]


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    return []


def shape_model(layers: int, shape: str = "0.6b", weights: str = "float32"):
    """Qwen3-0.6B's shape (or Qwen3.5-0.8B's, "0.8b": its first `layers` layer types) with `layers` layers and
    random weights (no checkpoint), as an LLM; its matrices in `weights` (a format of npqwen/weights.py)."""
    import numpy as np

    from npqwen.checkpoint import allocate_weights, is_matrix, stack_compact, tie_lm_head
    from npqwen.config import QWEN3_0_6B_CONFIG, QWEN3_5_0_8B_TEXT_CONFIG, Qwen3Config
    from npqwen.llm import LLM
    from npqwen.model import Qwen3
    from npqwen.weights import kept_format
    from tools.bench.weights import random_rows

    raw = dict(QWEN3_0_6B_CONFIG if shape == "0.6b" else QWEN3_5_0_8B_TEXT_CONFIG, num_hidden_layers=layers)
    if "layer_types" in raw:
        raw["layer_types"] = raw["layer_types"][:layers - 1] + ["full_attention"]   # at least one full layer
    config = Qwen3Config.from_dict(raw)
    arrays, fused = allocate_weights(config, np, np.dtype(np.float32))
    rng = np.random.default_rng(0)
    for name, array in arrays.items():   # norms scale by 1 (a Qwen3.5's by 1 + weight)
        norm = 1.0 if name.endswith("linear_attn.norm.weight") else 1.0 - config.norm_offset
        if name.endswith("norm.weight"):
            array[...] = norm
        elif weights == "float32" or not is_matrix(name):
            array[...] = rng.standard_normal(array.shape, np.float32) * 0.02
    if weights == "float32":
        return LLM(Qwen3(config, tie_lm_head(config, arrays), fused))
    # a matrix made in its format's own bytes (tools/bench/weights.py), never quantized from float32 (slow)
    compact = {name: random_rows(kept_format(weights, a.shape[1]), *a.shape, rng)
               if is_matrix(name) else a for name, a in arrays.items()
               if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    del arrays, fused
    return LLM(Qwen3(config, tie_lm_head(config, compact), stack_compact(config, compact)))


def main(argv=None):
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(prog="python -m tools.bench.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="layers of the shape (default 4)")
    p.add_argument("--shape", choices=("0.6b", "0.8b"), default="0.6b", help="Qwen3-0.6B's or Qwen3.5-0.8B's")
    p.add_argument("--weights", default="float32", help="weight formats, comma-separated (float32, bfloat16, int8, "
                                                        "q8_0, q4_k, ...): each measured in turn")
    p.add_argument("--json", help="also write every figure to this file")
    add_arguments(p)
    args = p.parse_args(argv)
    name = "Qwen3-0.6B" if args.shape == "0.6b" else "Qwen3.5-0.8B"
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    report = {"shape": args.shape, "layers": args.layers, "context": args.spec_context, "k": args.spec_k,
              "blas_threads": threads, "formats": {}}
    for fmt in [f for f in args.weights.split(",") if f]:
        llm = shape_model(args.layers, args.shape, fmt)
        times = verify_times(llm, args.spec_context, ks_of(args.spec_ks), args.spec_steps)
        print(f"{name} shape, {args.layers} layers, {fmt}, {args.spec_context} cached positions, "
              f"BLAS threads {threads}", flush=True)
        for n, t in times.items():
            print(f"  verify 1 + {n - 1} tokens: {t * 1e3:7.2f} ms  ({t / times[1]:.2f}x a 1-token step)", flush=True)
        out = speedups(llm, args.spec_k, args.spec_new_tokens, args.spec_repeats)
        print(f"  plain decode: {out['spec_plain_tps']:.1f} tok/s")
        for accept in ACCEPTANCE:
            print(f"  k={args.spec_k}, oracle drafts {accept}% right: {out[f'spec_{accept}_tps']:.1f} tok/s "
                  f"({out[f'spec_{accept}_tps'] / out['spec_plain_tps']:.2f}x), {out[f'spec_{accept}_kept_pct']:.0f}% "
                  f"kept", flush=True)
        report["formats"][fmt] = {**{f"spec_verify_{n}_s": t for n, t in times.items()}, **out}
        del llm
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
