"""Qwen4-Exp (model_type "qwen4_exp" / "qwen4_exp_text"): each new part checked against transformers' own module on
a tiny random config (hyper-connection mixing, PLE's n-gram hashing, lookup and layer with its dilated convolution,
the QSA indexer's block selection, the gated shared expert MoE); then the whole model read from the checkpoints
transformers writes (Qwen4ExpForCausalLM, and the hub's Qwen4ExpForConditionalGeneration with a vision tower and
sharded PLE tables): HF's float32 logits within tests/tolerance.py's bound and its greedy tokens; the engine
(batched = alone, chunked prefill, a prefix hit, preemption); and the refusals, each naming what it refuses."""

import numpy as np
import pytest

import npqwen
from conftest import greedy_both
from npqwen import Engine
from npqwen import hyper_connections as hc
from npqwen import ple
from npqwen.backend import free_memory_bytes
from npqwen.errors import NpqwenError

torch = pytest.importorskip("torch")
qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

TINY = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, hc_count=3, hc_lowrank=8, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000,
            make_ngram_vocab_size_divisible_by=16, seed=1234, eos_token_id=7, rms_norm_eps=1e-6,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
            ple_layer_ids=[1, 2], ple_embed_dim=8)


def config(**overrides):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**{**TINY, **overrides})


def randomize(module, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module.eval()


def close(name, ours, want, tol=1e-6):
    want = want.detach().numpy() if hasattr(want, "detach") else np.asarray(want)
    diff = float(np.abs(np.asarray(ours, dtype=np.float64) - want).max())
    print(f"{name}: max |diff| {diff:.2e} (max |HF| {np.abs(want).max():.2e})")
    assert ours.shape == want.shape and diff <= tol * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("C", [2, 3, 4])
def test_hyper_connection_mixing_equals_hf(C):
    module = randomize(qwen4.Qwen4ExpTextGatedResidual(config(hc_count=C)), seed=C)
    x = torch.randn(1, 9, C * 32)
    with torch.no_grad():
        mixed, same, w = module(x)
    W = {n: p.detach().numpy() for n, p in module.named_parameters()}
    xs = x[0].numpy()
    close("hc_norm", hc.grouped_rms_norm(xs, W["hc_norm.weight"], 32, 1e-6), module.hc_norm(x)[0])
    ours = hc.gated_residual(xs, W["hc_norm.weight"], W["input_mix_weight_down.weight"],
                             W["input_mix_weight_up.weight"], W["block_inject_weight.weight"], C, 1e-6)
    close("mixed input", ours[0], mixed[0])
    close("injection weights", ours[2], w[0])
    out = torch.randn(1, 9, 32)
    want = same + (out.unsqueeze(-2) * w.unsqueeze(-1)).flatten(-2)   # HF's decoder layer, after a block
    close("inject", hc.inject(xs, out[0].numpy(), ours[2]), want[0])


@pytest.mark.parametrize("ple_layer_index", [0, 1])
def test_ngram_hashing_and_lookup_equal_hf(ple_layer_index):
    cfg = config()
    module = randomize(qwen4.Qwen4ExpTextNGramEmbedding(cfg, embedding_dim=8, layer_idx=0,
                                                        ple_layer_index=ple_layer_index))
    mult = ple.layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_layer_index, cfg.seed)
    assert mult.tolist() == module.layer_multipliers.tolist()
    sizes, offsets = ple.head_vocab_sizes(cfg.ngram_vocab_size_base, module.ngram_heads, ple_layer_index)
    assert sizes.tolist() == module.ngram_heads_vocab_sizes.tolist()
    assert offsets.tolist() == module.ngram_heads_offsets.tolist()
    ids = np.array([5, 9, 7, 11, 12, 13, 7, 7, 200, 3, 299, 0], dtype=np.int64)   # eos (7) inside, twice in a row
    for shift in range(3):
        got = ple.shift_right_ignore_eos(ids, shift, 7)
        assert got.tolist() == module._shift_right_ignore_eos(torch.from_numpy(ids)[None], shift)[0].tolist(), shift
    with torch.no_grad():
        want = module(torch.from_numpy(ids)[None], cache=None)[0]                                    # (T, Hn*d)
    table = module.ngram_embedding.weight.detach().numpy()
    got = ple.ngram_embedding(table, ids, [7, 7], mult, sizes, offsets, cfg.heads_per_ngram, 7)
    close("n-gram embedding", got, want, tol=0)


@pytest.mark.parametrize("T, budget, r", [(37, 8, 4), (20, 12, 3), (5, 8, 4)])
def test_qsa_block_selection_equals_hf(T, budget, r):
    """The indexer's token selection for a causal prompt (blocks of r, budget // r kept, the tail always kept)."""
    from npqwen import qsa

    cfg = config(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=budget,
                 indexer_compress_ratio=r, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.5})
    module = randomize(qwen4.Qwen4ExpTextQSAIndexer(cfg, layer_idx=0), seed=T)
    x = torch.randn(1, T, 32)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 8, 2).float() / 8))                 # rotary over 8 of di = 16
    freqs = torch.arange(T).float()[:, None] * inv_freq
    cos, sin = torch.cat([freqs, freqs], -1).cos()[None], torch.cat([freqs, freqs], -1).sin()[None]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    with torch.no_grad():
        want = module(x, (cos, sin), causal, cache=None)[0, 0].numpy()              # (T, S)
    W = {n: p.detach().numpy() for n, p in module.named_parameters()}
    q, keys = qsa.indexer_queries_keys(x[0].numpy(), W["index_qk_proj.weight"], W["q_layernorm.weight"], 2, 16,
                                       cos[0].numpy(), sin[0].numpy(), cfg.rms_norm_eps)
    chosen = qsa.select_tokens(q, keys, causal[0, 0].numpy(), W["k_layernorm.weight"], cos[0].numpy(),
                               sin[0].numpy(), budget, r, cfg.rms_norm_eps)
    got = qsa.selection_mask(chosen, T)
    ties = 0
    for t in np.unique(np.argwhere(got != want)[:, 0]):   # a difference may only swap blocks of equal score
        seen = np.flatnonzero(causal[0, 0, t].numpy())
        blocks = seen[:len(seen) // r * r].reshape(-1, r)
        scores = qsa.block_scores(q[t], keys, blocks, W["k_layernorm.weight"], cos[0].numpy(), sin[0].numpy(),
                                  cfg.rms_norm_eps)
        ours, hf = (sorted(scores[[b for b in range(len(blocks)) if m[blocks[b]].all()]]) for m in (got[t], want[t]))
        assert np.allclose(ours, hf, atol=1e-6) and (got[t, seen[len(blocks) * r:]] == want[t, seen[len(blocks) * r:]]
                                                     ).all(), (t, ours, hf)
        ties += 1
    print(f"T={T} budget={budget} r={r}: {int(got.sum())} of {int(causal.sum())} visible kept; queries that "
          f"kept another block of the same score: {ties}")
    assert all(len(c) <= budget + r - 1 for c in chosen) and ties <= T // 4


@pytest.mark.parametrize("T, S, r, budget", [(37, 37, 4, 8), (1, 50, 4, 8), (13, 40, 3, 12), (3, 3, 4, 8),
                                             (70, 70, 1, 64), (40, 203, 8, 32)])
def test_qsa_selection_at_once_equals_query_by_query(T, S, r, budget, monkeypatch):
    """select_tokens on prefixes (a causal prompt, decode after a prefix, a chunk of a prefill) takes the path that
    pools the blocks once and scores all queries in one product per chunk, and picks exactly the positions, in the
    same order, that the query-by-query loop (select_tokens_each, its fallback for any other visibility) picks.
    Random keys rotated, and keys whose blocks repeat 3 patterns unrotated (equal scores, relu zeros or not, at the
    budget's edge); chunks of 3 queries (SCORES_BYTES made small) cross chunk edges; budget 64 of r=1 takes the
    sort (k > 32)."""
    from npqwen import ops, qsa

    rng = np.random.default_rng(T * S + r)
    monkeypatch.setattr(ops, "SCORES_BYTES", 4 * 2 * (S // r) * 3 + 1)   # 3 queries a chunk
    each = qsa.select_tokens_each
    monkeypatch.setattr(qsa, "select_tokens_each", None)                 # select_tokens must not fall back here
    edge_ties = 0
    for dtype, tied in ((np.float32, False), (np.float32, True), (np.float64, True)):
        q = rng.standard_normal((T, 2, 16)).astype(dtype)                           # (T, Hi, di)
        keys = rng.standard_normal((S, 16)).astype(dtype)                           # (S, di) raw
        if tied:   # each block one of 3 rows repeated, and no rotation: equal block keys
            keys = np.repeat(keys[rng.integers(0, 3, -(-S // r))], r, axis=0)[:S]
        angles = np.arange(S)[:, None] * (0.0 if tied else 1.0 / 1e4 ** (np.arange(0, 8, 2) / 8))   # rotary: 8 of 16
        cos, sin = (f(np.concatenate([angles, angles], 1)).astype(dtype) for f in (np.cos, np.sin))
        visible = np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]            # (T, S) causal, start S - T
        args = (keys, visible, 0.1 * rng.standard_normal(16).astype(dtype), cos, sin, budget, r, 1e-6)
        got, want = qsa.select_tokens(q, *args), each(q, *args)
        differ = [t for t in range(T) if got[t].dtype != want[t].dtype or not np.array_equal(got[t], want[t])]
        for t in range(T):   # ties at the edge: the budget's last kept block scores as the first left out
            n = S - T + t + 1
            scores = np.sort(qsa.block_scores(q[t], keys, np.arange(n // r * r).reshape(-1, r), args[2], cos, sin,
                                              1e-6))[::-1]
            edge_ties += len(scores) > budget // r and scores[budget // r - 1] == scores[budget // r]
        print(f"T={T} S={S} r={r} budget={budget} {np.dtype(dtype).name}{' tied' * tied}: {len(differ)} of {T} queries differ "
              f"(first {differ[:1]}); queries with a tie at the budget's edge so far: {edge_ties}")
        assert not differ, (differ[0], got[differ[0]], want[differ[0]])
    assert edge_ties or T < 4


def test_the_gated_shared_expert_moe_is_npqwens_qwen3_5_moe_block():
    """Qwen4-Exp's MLP (router, experts, sigmoid-gated shared expert) is the block npqwen runs for Qwen3.5-MoE:
    moe.route + moe.experts + sigmoid(shared_expert_gate x) * SwiGLU, on HF's module's weights."""
    from npqwen import moe, ops

    cfg = config(num_experts=8, num_experts_per_tok=3)
    module = randomize(qwen4.Qwen4ExpTextSparseMoeBlock(cfg))
    x = torch.randn(1, 11, 32)
    with torch.no_grad():
        want = module(x)[0]
    W = {n: p.detach().numpy() for n, p in module.named_parameters()}
    xs = x[0].numpy()
    _, chosen, weights = moe.route(xs, W["gate.weight"], 3, True)
    out = moe.experts(xs, chosen, weights, W["experts.gate_up_proj"], W["experts.down_proj"])     # (T, D)
    shared = ops.linear(ops.silu(ops.linear(xs, W["shared_expert.gate_proj.weight"]))
                        * ops.linear(xs, W["shared_expert.up_proj.weight"]), W["shared_expert.down_proj.weight"])
    close("sparse MoE + gated shared expert", out + ops.sigmoid(ops.linear(xs, W["shared_expert_gate.weight"]))
          * shared, want)


def test_ple_layer_with_its_dilated_convolution_equals_hf():
    """The PLE layer (gate per stream, grouped norms, the dilated depthwise convolution) on HF's module's weights,
    a prompt at once and then continued from the convolution's state (what a decoding step reads)."""
    cfg = config()
    module = randomize(qwen4.Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=0))
    W = {f"p.{n}": p.detach().numpy() for n, p in module.named_parameters()}
    ids = np.array([5, 9, 7, 11, 12, 13, 7, 200, 3, 299, 0, 4, 8], dtype=np.int64)
    x = torch.randn(1, len(ids), 3 * 32)
    with torch.no_grad():
        want = module(x, torch.from_numpy(ids)[None], cache=None)[0]                        # (T, C*D)
    table, mult = W["p.ple_embedding.ngram_embedding.weight"], module.ple_embedding.layer_multipliers.numpy()
    sizes, offsets = ple.head_vocab_sizes(cfg.ngram_vocab_size_base, 4, 0)
    L = (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size
    emb = ple.ngram_embedding(table, ids, [7, 7], mult, sizes, offsets, 2, 7)
    got, state = ple.ple_layer(x[0].numpy(), emb, W, "p", 3, np.zeros((L, 96), np.float32), 3, 1e-6)
    close("PLE layer, whole prompt", got, want)
    first, rest = 8, slice(8, None)   # the same in two calls: the second from the first's state and last tokens
    _, state = ple.ple_layer(x[0, :first].numpy(), emb[:first], W, "p", 3, np.zeros((L, 96), np.float32), 3, 1e-6)
    emb2 = ple.ngram_embedding(table, ids[rest], ids[first - 2:first], mult, sizes, offsets, 2, 7)
    got2, _ = ple.ple_layer(x[0, rest].numpy(), emb2, W, "p", 3, state, 3, 1e-6)
    close("PLE layer, continued from its state", got2, want[rest])


# -- the whole model, read from the checkpoints transformers writes --

MODEL = dict(TINY, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
             indexer_compress_ratio=4, split_ngram_parts=2, max_position_embeddings=512)
# QSA's top blocks by relu(q . k) scores: with 8 indexer heads a block scores exactly 0 (a tie, whose order torch.topk
# leaves unspecified) only where all 8 dot products are negative, so the random models here have no tie at the edge
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
CASES = {   # name -> (text config overrides, hub layout, save dtype, prompt length)
    "causal-C3-PLE-in-2-shards": ({}, False, "float32", 40),
    "hub-layout-vision-C4-GQA-partial-rope-bf16": (dict(hc_count=4, hidden_size=32, num_attention_heads=4,
                                                        num_key_value_heads=2, indexer_compress_ratio=3,
                                                        indexer_budget=6, ple_layer_ids=[1, 3], split_ngram_parts=4,
                                                        layer_types=["linear_attention", "full_attention",
                                                                     "linear_attention", "full_attention"],
                                                        rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                         "partial_rotary_factor": 0.5,
                                                                         "mrope_section": [2, 1, 1],
                                                                         "mrope_interleaved": True}),
                                                   True, "bfloat16", 50),
}


def build(path, text=None, hub=False, save_dtype="float32", seed=0):
    """A random Qwen4ExpForCausalLM (or the hub's Qwen4ExpForConditionalGeneration: text_config, a one-block vision
    tower, model.language_model.*), saved by transformers; HF's float32 model of the same files."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    text = {**MODEL, **(text or {})}
    torch.manual_seed(seed)
    model = (Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(text_config=text, vision_config=VISION)) if hub
             else qwen4.Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**text)))
    randomize(model, seed)
    model.to(getattr(torch, save_dtype)).save_pretrained(path)
    cls = Qwen4ExpForConditionalGeneration if hub else qwen4.Qwen4ExpForCausalLM
    return path, cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen4_causal"))


def golden(llm, ref, ids, what):
    from tolerance import model_tolerance, relative_diff

    logits = llm.forward(ids)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    rel, bound = relative_diff(logits, want), model_tolerance(llm.config, len(ids))
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    print(f"{what}: max |logit diff| {np.abs(logits - want).max():.3e}, relative {rel:.3e} (bound {bound:.1e}), "
          f"argmax mismatches {mismatch[:10].tolist()} of {len(ids)}")
    assert rel <= bound and mismatch.size == 0


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case, tmp_path, causal):
    text, hub, dtype, T = CASES[case]
    path, ref = causal if case.startswith("causal") else build(tmp_path, text, hub, dtype, seed=1)
    llm = npqwen.load(path)
    assert llm.config.qwen4_exp and not any("visual" in n for n in llm.weights)
    table = llm.model.weights["model.layers.0.ple.ple_embedding.ngram_embedding.weight"]
    assert isinstance(table, ple.NgramTable) and len(table.parts) == (4 if hub else 2)   # left on disk, mapped
    ids = np.random.default_rng(0).integers(0, MODEL["vocab_size"], T).tolist()
    ids[7] = ids[8] = MODEL["eos_token_id"]   # n-grams never reach back past an end of text
    golden(llm, ref, ids, case)


def test_greedy_equals_hf(causal):
    path, ref = causal
    llm = npqwen.load(path)
    prompt = np.random.default_rng(1).integers(0, 300, 20).tolist()
    got, want = greedy_both(llm, ref, prompt, 12)
    assert got == want and len(set(got)) > 3


def test_what_npqwen_saves_is_what_transformers_saves(causal, tmp_path):
    """llm.save writes the tensors save_pretrained writes for the same model, the PLE tables as their shards and
    each PLE layer's three hash constants (int64 buffers in HF) equal to HF's, so transformers loads it with nothing
    missing (no LOAD REPORT) and gives the original's logits."""
    from safetensors.numpy import load_file

    path, ref = causal
    saved = npqwen.load(path).save(tmp_path / "npqwen")
    hf, ours = load_file(path / "model.safetensors"), load_file(saved / "model.safetensors")
    print("only in HF's", sorted(hf.keys() - ours.keys()), "only in npqwen's", sorted(ours.keys() - hf.keys()))
    assert ours.keys() == hf.keys()
    constants = [n for n, a in hf.items() if a.dtype == np.int64]
    assert len(constants) == 3 * len(MODEL["ple_layer_ids"]) and all((ours[n] == hf[n]).all() for n in constants)
    again, info = qwen4.Qwen4ExpForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    ids = torch.tensor([np.random.default_rng(4).integers(0, MODEL["vocab_size"], 24).tolist()])
    with torch.no_grad():
        want, got = (m(input_ids=ids, use_cache=False).logits for m in (ref, again.eval()))
    diff = float((got - want).abs().max())
    print(f"transformers on npqwen's save: missing {info['missing_keys']}, max |logit diff| vs the original {diff}")
    assert not info["missing_keys"] and not info["unexpected_keys"] and diff == 0


# Qwen4-Exp's layer at full width: transformers' defaults are the real model's (D=2048, 16/2 heads of 256, Gated
# DeltaNet 16/32 heads of 128, C=4 streams mixed at rank 320, experts of 512, PLE of 16 hash heads of 128); cut: 4
# experts (of 512; each the real shape), a 2,048-token vocabulary, PLE tables of ~1,000 rows per head (of 20M), and
# the indexer's sizes, which transformers leaves unset (16 heads of 128, blocks of 8, budget 32), rotary 64 of 256
REAL = dict(vocab_size=2048, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, hc_count=4, hc_lowrank=320, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, num_experts=4, num_experts_per_tok=2, ple_layer_ids=[1],
            ple_embed_dim=2048, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=1000,
            make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4, indexer_n_heads=16, indexer_kv_heads=1,
            indexer_head_dim=128, indexer_budget=32, indexer_compress_ratio=8, eos_token_id=7,
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


@pytest.mark.skipif(free_memory_bytes(np) < 4 * 2**30, reason="Qwen4-Exp's layers at full width need ~2 GiB (two "
                    "layers of D=2048 with 4 full-size experts, in HF, in its file and in npqwen)")
def test_a_real_layer_shape(tmp_path):
    path, ref = build_real(tmp_path)
    llm = npqwen.load(path)
    assert (llm.model.heads, llm.model.kv_heads, llm.config.rotary_dim, llm.config.hc_count) == (16, 2, 64, 4)
    golden(llm, ref, np.random.default_rng(2).integers(0, 2048, 56).tolist(), "Qwen4-Exp layer shape, 2 layers")


def build_real(path):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    torch.manual_seed(3)
    model = qwen4.Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**REAL))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("norm.weight") or "A_log" in name else 0.02)
    model.save_pretrained(path)
    return path, model.eval()


# -- the engine: batched = alone, chunked prefill, a prefix hit, preemption (float64: only the order of sums differs) --

@pytest.fixture(scope="module")
def causal64(causal):
    return npqwen.load(causal[0], dtype="float64")


def test_engine_batched_chunked_equals_alone(causal64):
    from test_engine import alone, compare, prompts, run

    ps = prompts([3, 40, 90], seed=3, vocab=300)
    engine = Engine(causal64, kv_cache_tokens=16 * 32, page_size=16, max_batched_tokens=32)
    for p, (tokens, logits, _) in zip(ps, run(engine, [(p, dict(max_new_tokens=5, temperature=0)) for p in ps],
                                          spy=True)):
        assert compare(f"batched, chunked: prompt {len(p)}", tokens, logits, *alone(causal64, p, 5)) <= 1e-10


def test_engine_prefix_hit_and_preemption_equal_a_miss(causal64):
    """A hit reuses the pages (keys, values and QSA's raw indexer keys) and restores the linear and PLE states from
    a snapshot; preemption recomputes. Both select the same blocks and give the same tokens."""
    from test_engine import alone, compare, prompts, run

    P = 16
    shared = prompts([5 * P], seed=4, vocab=300)[0]
    first, second = shared + prompts([7], seed=5, vocab=300)[0], shared + prompts([20], seed=6, vocab=300)[0]
    kw = dict(max_new_tokens=6, temperature=0)
    engine = Engine(causal64, kv_cache_tokens=64 * P, page_size=P)
    run(engine, [(first, kw)])
    (hit, hit_logits, _), = run(engine, [(second, kw)], spy=True)
    print("prefix hit tokens:", engine.stats["prefix_cache_hit_tokens"])
    assert engine.stats["prefix_cache_hit_tokens"] == 5 * P
    assert compare("prefix hit", hit, hit_logits, *alone(causal64, second, 6)) <= 1e-10
    ps = prompts([3, 40, 90], seed=7, vocab=300)
    tight = Engine(causal64, kv_cache_tokens=16 * 9, page_size=16, max_batched_tokens=64)
    outs = run(tight, [(p, dict(max_new_tokens=12, temperature=0)) for p in ps], spy=True)
    print("preemptions:", tight.stats["preemptions"])
    assert tight.stats["preemptions"] > 0
    for p, (tokens, logits, _) in zip(ps, outs):
        assert compare(f"preempted: prompt {len(p)}", tokens, logits, *alone(causal64, p, 12)) <= 1e-10


def test_trace_hooks_and_lens(causal):
    """Every step under its HF module name (the streams (T, C*D) at a layer's output), a hook that changes a value,
    and the logit lens, whose last layer is the model's own distribution (the final mixing in the norm's place)."""
    from npqwen.hooks import step_names
    from npqwen.lens import logit_attribution, logit_lens

    llm = npqwen.load(causal[0])
    ids = list(range(10, 40))
    logits, cache = llm.run_with_cache(ids)
    assert list(cache) == step_names(llm.config)
    assert cache["model.layers.3"].shape == (30, 3 * 32) and cache["model.layers.3.self_attn.indexer"].shape == (30, 30)
    kept = cache["model.layers.3.self_attn.indexer"].sum(-1)
    print("tokens each query of the QSA layer reads:", kept.tolist())
    assert kept.max() <= MODEL["indexer_budget"] + MODEL["indexer_compress_ratio"] - 1 < 30
    ablated = llm.run_with_hooks(ids, {"model.layers.3.self_attn.o_proj": lambda a, name: a * 0})
    assert np.abs(ablated - logits).max() > 1e-2
    lens = logit_lens(llm, ids)
    assert (lens.top_ids[-1, :, 0] == logits.argmax(-1)).all()
    with pytest.raises(NpqwenError, match="hc_count streams"):
        logit_attribution(llm, ids, 5)


def test_refusals_name_what_they_refuse(causal):
    """A QSA variant, a malformed mRoPE section, a GELU output gate; the MTP head on a Qwen4-Exp model (LoRA:
    tests/test_qwen4_exp_lora.py; tensor parallelism: tests/test_parallel.py; compact weights:
    tests/test_qwen4_exp_weights.py; gradients and LoRA finetuning: tests/test_backward.py, tests/test_finetune.py)."""
    from npqwen.config import Qwen3Config

    raw = {"model_type": "qwen4_exp_text", **MODEL}
    for change, named in ((dict(indexer_kv_heads=2), "indexer_kv_heads 2: a QSA variant"),
                          (dict(indexer_topk_method="dynamic"), "'indexer_topk_method' describes a QSA variant"),
                          (dict(indexer_budget=None), "missing: indexer_budget"),
                          (dict(indexer_budget=10), "indexer_budget 10 is not a multiple"),
                          (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                 "mrope_section": [8, 8]}), r"mrope_section \[8, 8\]"),
                          (dict(output_gate_type="gelu"), "output_gate_type 'gelu'"),
                          (dict(ple_layer_ids=[4]), r"ple_layer_ids \[4\] are attention layers")):
        with pytest.raises(NpqwenError, match=named) as error:
            Qwen3Config.from_dict({**raw, **change})
        print(error.value)
    llm = npqwen.load(causal[0])
    with pytest.raises(NpqwenError, match='speculative method "mtp" is not implemented for it'):
        llm.generate([1, 2, 3], max_new_tokens=2, temperature=0, speculative={"method": "mtp", "k": 3})


def test_inspect_prints_what_a_request_costs(causal):
    """The QSA layers' KV (keys, values and the indexer's raw key), the PLE states, the PLE tables on disk, and the
    figures computed from the config (no weights read)."""
    from npqwen.describe import describe

    text = describe(str(causal[0]))
    print(text[text.index("Qwen4-Exp ("):text.index("weights (")])
    per_token = 2 * 1 * 16 * 4 + 16 * 4   # one QSA layer: K=1 head of 16 for keys and values, di=16, float32
    assert "QSA layers                 [3]: per token 128 bytes of keys and values + 64 of the indexer's" in text
    assert f"KV cache per token         {per_token} bytes in float32" in text
    assert "PLE layers                 [0, 1]: per request 2 x conv state [9, 96] + the last 2 token ids" in text
    assert "[4,064, 2] F32 in 2 part(s)" in text and "16,448 parameters" in text and "memory-mapped" in text
    assert "not used by npqwen" not in text and "MISSING" not in text


def test_the_server_and_the_vision_tower(tmp_path):
    """A chat completion through `npqwen serve`'s app equals llm.generate, the web page's logit-lens probe reads the
    streams through the final mixing (its last layer is the model's own probability); an image is refused by name
    (npqwen reads the text model; the vision tower's weights stay on disk). The hub layout, Qwen3's tokenizer."""
    pytest.importorskip("fastapi")
    from conftest import add_qwen3_tokenizer, needs_qwen3_tokenizer
    from serving import LiveServer, assert_image_refused, http_json
    from tolerance import model_tolerance, relative_diff

    needs_qwen3_tokenizer()
    path, ref = build(tmp_path, dict(vocab_size=151936, eos_token_id=151645), hub=True, seed=2)
    llm = npqwen.load(add_qwen3_tokenizer(path))
    live = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=512, page_size=16))
    try:
        messages = [{"role": "user", "content": "What is a hyper-connection?"}]
        body = dict(model="test-model", messages=messages, temperature=0, max_tokens=8, return_token_ids=True,
                    chat_template_kwargs={"enable_thinking": False})
        status, chat = http_json("POST", live.url + "/v1/chat/completions", body)
        assert status == 200, chat
        want = llm.generate(llm.chat_prompt(messages, enable_thinking=False), max_new_tokens=8, temperature=0)
        print("server", chat["choices"][0]["token_ids"], "generate", want.token_ids)
        assert chat["choices"][0]["token_ids"] == want.token_ids
        ids = llm.prompt_ids("Four streams, one lens.")   # the web page's layers probe: each layer's logit lens
        status, lens = http_json("POST", live.url + "/v1/npqwen/layers", dict(tokens=ids, position=5))
        logits = llm.forward(ids[:5])[-1].astype(np.float64)
        p = np.exp(logits - logits.max())
        want = (p / p.sum())[ids[5]]
        print(status, [layer["probability"] for layer in lens["layers"]], want)
        assert status == 200 and abs(lens["layers"][-1]["probability"] / want - 1) < 1e-4
        # the saliency view: gradient x input of log p(token 5) per token before it, as HF's backward gives it
        status, saliency = http_json("POST", live.url + "/v1/npqwen/saliency", dict(tokens=ids, position=5))
        embedded = []
        hook = ref.get_input_embeddings().register_forward_hook(lambda m, a, out: embedded.append(out))
        log_p = torch.log_softmax(ref(input_ids=torch.tensor([ids[:5]]), use_cache=False).logits[0, -1], -1)[ids[5]]
        hook.remove()
        d_embedded, = torch.autograd.grad(log_p, embedded[0])    # the embedding's gradient only (no weight's)
        want = (d_embedded * embedded[0]).sum(-1)[0].detach().numpy()                        # (5,)
        diff, bound = relative_diff(saliency["scores"], want), 2 * model_tolerance(llm.config, 5)   # forward, backward
        print(status, "saliency", saliency["scores"], "HF", want.tolist(), f"relative {diff:.1e} (bound {bound:.1e})")
        assert status == 200 and diff <= bound
        assert_image_refused(live.url)
    finally:
        live.close()
