"""step: the many-token steps, a --step-prefill token prefill and one decode step of --step-batch
sequences with --step-context cached positions each; for npqwen, each beside its linear layers alone
at the same shapes (ops.linear on the model's own weights)."""
import sys

from tools.bench.engines import PEERS
from tools.bench.machine import best_time
from tools.bench.tables import row

NAME, WORKER, NEEDS = "step", "single", ()

TARGETS = [  # (figure, comparison, threshold, label); threshold 0: reported, no target
    ("step_prefill_pct_of_matmul", ">=", 75, "prefill step: its linear layers alone, % of the step"),
    ("step_batch_pct_of_matmul", ">=", 75, "batched decode step: its linear layers alone, % of the step"),
    ("step_prefill_vs_hf-float32", ">=", 0, "prefill step vs HF float32 (time ratio)"),
    ("step_prefill_vs_hf-bfloat16", ">=", 0, "prefill step vs HF bfloat16 (time ratio)"),
    ("step_batch_vs_hf-float32", ">=", 0, "batched decode step vs HF float32 (time ratio)"),
    ("step_batch_vs_hf-bfloat16", ">=", 0, "batched decode step vs HF bfloat16 (time ratio)"),
    ("step_prefill_vs_hf-float16", ">=", 0, "prefill step vs HF float16 (time ratio)"),
    ("step_batch_vs_hf-float16", ">=", 0, "batched decode step vs HF float16 (time ratio)"),
]
ROWS = {"step_prefill_s": "prefill step (s)", "step_prefill_matmul_s": "  its linear layers alone (s)",
        "step_batch_s": "batched decode step (s)", "step_batch_matmul_s": "  its linear layers alone (s)"}


def add_arguments(p):
    p.add_argument("--step-prefill", type=int, default=1024, help="step: prompt length of the prefill step")
    p.add_argument("--step-batch", type=int, default=32, help="step: decoding sequences in the batched step")
    p.add_argument("--step-context", type=int, default=512, help="step: cached positions of each of them")
    p.add_argument("--profile", action="store_true", help="step: cProfile npqwen's steps (table on stderr)")


def runs_on(engine, args) -> bool:
    return True


def run(engine, args, rng) -> dict:
    """Each step's time (best of --repeats) and, for npqwen, its linear layers' alone."""
    return npqwen_steps(engine, args) if engine.name == "npqwen" else hf_steps(engine, args)


def npqwen_steps(engine, args) -> dict:
    import numpy as np

    from npqwen.generate import PREFILL_CHUNK
    from npqwen.kv_cache import Batch, KVCache

    model = engine.model
    rng, cfg, xp = np.random.default_rng(1), engine.llm.config, model.xp
    T = args.step_prefill
    ids = rng.integers(0, engine.vocab_size, T).tolist()
    chunks = [min(PREFILL_CHUNK, T - s) for s in range(0, T, PREFILL_CHUNK)]
    # B sequences of `context` cached positions, each decoding one token; keys and values filled
    # (zero pages that were never written would be read from the OS's shared zero page: too fast)
    B, S, P = args.step_batch, args.step_context, 256
    per_seq = -(-(S + 1) // P)
    kv = KVCache(cfg, B * per_seq, P, xp, model.dtype)
    kv.keys.fill(0.01)
    kv.values.fill(0.01)
    batch = Batch(rng.integers(0, engine.vocab_size, B), [S] * B, [1] * B,
                  [np.arange(b * per_seq, (b + 1) * per_seq) for b in range(B)], P, sample_rows=np.arange(B))
    prefill = lambda: engine.prefill(ids, T)                                      # noqa: E731
    step = lambda: xp.asarray(model.forward_batch(batch, kv).logits)[0, 0].item()        # noqa: E731
    layers = LinearLayers(engine)
    out = {"step_prefill_s": best_time(prefill, args.repeats),
           "step_prefill_matmul_s": best_time(lambda: [layers(n, 1) for n in chunks], args.repeats),
           "step_batch_s": best_time(step, args.repeats),
           "step_batch_matmul_s": best_time(lambda: layers(B, B), args.repeats)}
    if args.profile:
        import cProfile
        import pstats
        for name, fn in (("prefill", prefill), ("batch", step)):
            profile = cProfile.Profile()
            profile.runcall(fn)
            print(f"\n[bench] npqwen {name} step, by own time:", file=sys.stderr)
            pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(12)
    return out


class LinearLayers:
    """A step's linear layers alone: q/k/v, o, gate/up and down of every layer for `rows` tokens,
    and lm_head for `sampled` of them, through ops.linear as the model calls it."""

    def __init__(self, engine):
        self.model, self.cfg, self.inputs = engine.model, engine.llm.config, (None,)

    def __call__(self, rows: int, sampled: int):
        from npqwen import ops

        xp, W, fused, cfg = self.model.xp, self.model.weights, self.model.fused, self.cfg
        if self.inputs[0] != rows:
            ones = lambda n: xp.ones((rows, n), dtype=self.model.dtype)                  # noqa: E731
            self.inputs = (rows, ones(cfg.hidden_size), ones(cfg.num_attention_heads * cfg.head_dim),
                           ones(cfg.intermediate_size))
        _, x, a, f = self.inputs
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            ops.linear(x, fused[f"{p}.self_attn.qkv_proj.weight"])
            ops.linear(a, W[f"{p}.self_attn.o_proj.weight"])
            ops.linear(x, fused[f"{p}.mlp.gate_up_proj.weight"])
            ops.linear(f, W[f"{p}.mlp.down_proj.weight"])
        y = ops.linear(x[:sampled], W["lm_head.weight"])
        return xp.asarray(y)[0, 0].item()   # on CuPy: wait for the GPU


def hf_steps(engine, args) -> dict:
    """The prefill, and one batched decode step over a DynamicCache of --step-context positions per
    sequence (filled directly, as npqwen's pages are)."""
    import numpy as np
    from transformers import DynamicCache

    torch, model, cfg = engine.torch, engine.model, engine.model.config
    ids = np.random.default_rng(1).integers(0, engine.vocab_size, args.step_prefill).tolist()
    B, S = args.step_batch, args.step_context
    cache = DynamicCache()
    shape = (B, cfg.num_key_value_heads, S, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        full = torch.full(shape, 0.01, dtype=model.dtype, device=engine.device)
        cache.update(full, full.clone(), layer)
    tokens = torch.randint(0, engine.vocab_size, (B, 1), device=engine.device)

    def step():
        with torch.inference_mode():
            out = model(tokens, past_key_values=cache, use_cache=True)
        cache.crop(-1)   # back to S positions for the next run (transformers 5: a negative count drops)
        return float(out.logits[0, -1, 0])
    return {"step_prefill_s": best_time(lambda: engine.prefill(ids, len(ids)), args.repeats),
            "step_batch_s": best_time(step, args.repeats)}


def figures(report) -> dict:
    """Each step's linear layers alone as a % of it, and the peers' step time over npqwen's."""
    e, f = report["engines"], {}
    ours = e.get("npqwen", {})
    for step in ("prefill", "batch"):
        if f"step_{step}_s" in ours:
            f[f"step_{step}_pct_of_matmul"] = 100 * ours[f"step_{step}_matmul_s"] / ours[f"step_{step}_s"]
            for peer in PEERS:
                if f"step_{step}_s" in e.get(peer, {}):
                    f[f"step_{step}_vs_{peer}"] = e[peer][f"step_{step}_s"] / ours[f"step_{step}_s"]
    return f


def rows(report) -> list:
    return [row(report, key, label, "{:.3f}") for key, label in ROWS.items()
            if any(key in figures for figures in report["engines"].values())]


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    return []
