"""moe: Qwen3-MoE's steps at the Qwen3-30B-A3B layer shape (a random 2-layer checkpoint: hidden 2048,
32/4 heads of 128, 128 experts of width 768, 8 per token, the real vocabulary): a --moe-prefill (512)
token step and one decode step of --moe-batch (32) requests with --moe-context (512) cached positions
each. For npqwen, beside each: the expert matrix products alone, and all its linear layers alone
(attention's, the router's, the experts', lm_head's), at the step's own shapes: the experts each took
as many rows as the router gave them in that step. HF runs its default experts implementation
(grouped_mm in transformers 5: one sort, then one grouped product) and its eager one (a Python loop
over the experts that have tokens). Runs alone, on its own checkpoint (--suites moe; built once)."""
from tools.bench.machine import best_time
from tools.bench.tables import row

NAME, WORKER, NEEDS = "moe", "single", ()

TARGETS = [  # (figure, comparison, threshold, label); threshold 0: reported, no target
    ("moe_prefill_pct_of_matmul", ">=", 60, "MoE prefill step: its matrix products alone, % of the step"),
    ("moe_prefill_vs_hf-float32", ">=", 1, "MoE prefill step vs HF float32 (time ratio; HF's faster experts code)"),
    ("moe_batch_vs_hf-float32", ">=", 1, "MoE batched decode step vs HF float32 (time ratio; the same)"),
    ("moe_prefill_pct_of_experts", ">=", 0, "MoE prefill step: its expert products alone, % of the step"),
    ("moe_batch_pct_of_experts", ">=", 0, "MoE batched decode step: its expert products alone, % of the step"),
    ("moe_batch_pct_of_matmul", ">=", 0, "MoE batched decode step: its matrix products alone, % of the step"),
    ("moe_prefill_vs_hf-bfloat16", ">=", 0, "MoE prefill step vs HF bfloat16 (time ratio)"),
    ("moe_batch_vs_hf-bfloat16", ">=", 0, "MoE batched decode step vs HF bfloat16 (time ratio)"),
]
ROWS = {"moe_prefill_s": "MoE prefill step (s)", "moe_prefill_eager_s": "  HF, eager experts loop (s)",
        "moe_prefill_experts_s": "  its expert products alone (s)",
        "moe_prefill_matmul_s": "  all its matrix products alone (s)",
        "moe_batch_s": "MoE batched decode step (s)", "moe_batch_eager_s": "  HF, eager experts loop (s)",
        "moe_batch_experts_s": "  its expert products alone (s)",
        "moe_batch_matmul_s": "  all its matrix products alone (s)"}


def add_arguments(p):
    p.add_argument("--moe-prefill", type=int, default=512, help="moe: tokens of the prefill step")
    p.add_argument("--moe-batch", type=int, default=32, help="moe: decoding requests in the batched step")
    p.add_argument("--moe-context", type=int, default=512, help="moe: cached positions of each of them")


def runs_on(engine, args) -> bool:
    return True


def run(engine, args, rng) -> dict:
    return npqwen_steps(engine, args) if engine.name == "npqwen" else hf_steps(engine, args)


def npqwen_steps(engine, args) -> dict:
    import numpy as np

    from npqwen.kv_cache import Batch, KVCache

    model, cfg = engine.model, engine.llm.config
    rng, xp = np.random.default_rng(1), model.xp
    T, B, S, P = args.moe_prefill, args.moe_batch, args.moe_context, 256
    per_seq = -(-(S + 1) // P)
    kv = KVCache(cfg, max(B * per_seq, -(-T // P)), P, xp, model.dtype)
    kv.keys.fill(0.01)     # written pages: zero pages never written would read the OS's shared zero page
    kv.values.fill(0.01)
    prefill = Batch(rng.integers(0, engine.vocab_size, T), [0], [T], [np.arange(-(-T // P))], P,
                    sample_rows=np.array([T - 1]))
    decode = Batch(rng.integers(0, engine.vocab_size, B), [S] * B, [1] * B,
                   [np.arange(b * per_seq, (b + 1) * per_seq) for b in range(B)], P, sample_rows=np.arange(B))
    out = {"moe_sizes": [T, B, S]}
    for name, batch in (("prefill", prefill), ("batch", decode)):
        step = lambda: xp.asarray(model.forward_batch(batch, kv).logits)[0, 0].item()    # noqa: E731
        products = Products(engine, expert_rows(model, batch, kv), len(batch.token_ids), len(batch.sample_rows))
        out[f"moe_{name}_s"] = best_time(step, args.repeats)
        out[f"moe_{name}_experts_s"] = best_time(lambda: products(experts_only=True), args.repeats)
        out[f"moe_{name}_matmul_s"] = best_time(products, args.repeats)
        out[f"moe_{name}_active_experts"] = float(np.mean([np.count_nonzero(n) for n in products.rows.values()]))
    return out


def expert_rows(model, batch, kv) -> dict:
    """{layer: (E,) rows each expert takes in this step}, from one recorded run of it."""
    from npqwen.moe import expert_load

    rows = {}

    def keep(name, array):
        if name.endswith(".mlp.gate.top_k_index"):
            rows[int(name.split(".")[2])] = expert_load(array, model.config.num_experts)
    model.forward_batch(batch, kv, keep)
    return rows


class Products:
    """A step's matrix products alone, through ops.linear as the model calls them, on inputs of ones:
    per layer q/k/v, o, the router and each expert's two products over the rows it took (or a dense
    layer's gate/up and down), and lm_head for the sampled rows; with experts_only, the experts' alone."""

    def __init__(self, engine, rows: dict, tokens: int, sampled: int):
        xp, cfg, dtype = engine.model.xp, engine.llm.config, engine.model.dtype
        self.model, self.cfg, self.rows, self.sampled = engine.model, cfg, rows, sampled
        ones = lambda n, d: xp.ones((n, d), dtype=dtype)                                   # noqa: E731
        self.x, self.a = ones(tokens, cfg.hidden_size), ones(tokens, cfg.num_attention_heads * cfg.head_dim)
        self.f = ones(tokens, cfg.intermediate_size)
        self.e = ones(max(int(n.max()) for n in rows.values()), cfg.moe_intermediate_size) if rows else None

    def __call__(self, experts_only: bool = False):
        from npqwen import ops

        W, fused, cfg, x = self.model.weights, self.model.fused, self.cfg, self.x
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            if not experts_only:
                ops.linear(x, fused[f"{p}.self_attn.qkv_proj.weight"])
                ops.linear(self.a, W[f"{p}.self_attn.o_proj.weight"])
            if i in self.rows:
                if not experts_only:
                    ops.linear(x, W[f"{p}.mlp.gate.weight"])
                gate_up, down = fused[f"{p}.mlp.experts.gate_up_proj"], fused[f"{p}.mlp.experts.down_proj"]
                for e, n in enumerate(self.rows[i].tolist()):
                    if n:
                        ops.linear(x[:n], gate_up[e])
                        ops.linear(self.e[:n], down[e])
            elif not experts_only:
                ops.linear(x, fused[f"{p}.mlp.gate_up_proj.weight"])
                ops.linear(self.f, W[f"{p}.mlp.down_proj.weight"])
        y = ops.linear(x[:self.sampled], W["lm_head.weight"]) if not experts_only else x
        return self.model.xp.asarray(y)[0, 0].item()   # on CuPy: wait for the GPU


def hf_steps(engine, args) -> dict:
    """The prefill step and one batched decode step over a DynamicCache of --moe-context positions per
    request, with HF's default experts implementation, then with its eager loop."""
    import numpy as np
    from transformers import DynamicCache

    torch, model, cfg = engine.torch, engine.model, engine.model.config
    rng = np.random.default_rng(1)
    ids = rng.integers(0, engine.vocab_size, args.moe_prefill).tolist()
    B, S = args.moe_batch, args.moe_context
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
    out = {"moe_experts_implementation": model.config._experts_implementation}
    for suffix, implementation in (("", None), ("_eager", "eager")):
        if implementation:
            model.set_experts_implementation(implementation)
        out[f"moe_prefill{suffix}_s"] = best_time(lambda: engine.prefill(ids, len(ids)), args.repeats)
        out[f"moe_batch{suffix}_s"] = best_time(step, args.repeats)
    return out


def figures(report) -> dict:
    """npqwen's expert products and all its matrix products alone as a % of each step, and each HF
    engine's step time over npqwen's (its faster experts implementation)."""
    e, f = report["engines"], {}
    ours = e.get("npqwen", {})
    for step in ("prefill", "batch"):
        if f"moe_{step}_s" not in ours:
            continue
        for part in ("experts", "matmul"):
            f[f"moe_{step}_pct_of_{part}"] = 100 * ours[f"moe_{step}_{part}_s"] / ours[f"moe_{step}_s"]
        for peer in ("hf-float32", "hf-bfloat16"):
            times = [e.get(peer, {}).get(f"moe_{step}{s}_s") for s in ("", "_eager")]
            if any(times):
                f[f"moe_{step}_vs_{peer}"] = min(t for t in times if t) / ours[f"moe_{step}_s"]
    return f


def rows(report) -> list:
    return [row(report, key, label, "{:.3f}") for key, label in ROWS.items()
            if any(key in figures for figures in report["engines"].values())]


def tables(report) -> list:
    return []


def notes(report) -> list[str]:
    ours = report["engines"].get("npqwen", {})
    hf = {n: v["moe_experts_implementation"] for n, v in report["engines"].items() if "moe_experts_implementation" in v}
    out = []
    if "moe_batch_active_experts" in ours:
        T, B, S = ours["moe_sizes"]
        out.append(f"MoE steps: a prefill of {T} tokens, and a decode step of {B} requests with {S} cached "
                   f"positions each. Experts with tokens, per layer: {ours['moe_prefill_active_experts']:.0f} in "
                   f"the prefill step, {ours['moe_batch_active_experts']:.0f} in the decode step (random router).")
    if hf:
        out.append("HF's default experts implementation: " + ", ".join(f"{n} {v}" for n, v in hf.items())
                   + "; the row under it is its eager loop.")
    return out
