"""Qwen4-Exp (model_type "qwen4_exp"): the parts npqwen has, each checked against transformers' own module on a
tiny random config (hyper-connection mixing, PLE's n-gram hashing and lookup, the QSA indexer's block selection,
the gated shared expert MoE), and the refusal that names what npqwen does not have yet (attention over the QSA
selection, the PLE layer's convolution, MTP, loading, the decoder layer)."""
import json

import numpy as np
import pytest

import npqwen
from npqwen import hyper_connections as hc
from npqwen import ple
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


def test_a_qwen4_exp_config_is_refused_naming_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "architectures":
                                                      ["Qwen4ExpForConditionalGeneration"], "text_config": TINY}))
    with pytest.raises(NpqwenError) as error:
        npqwen.load(tmp_path)
    print(error.value)
    for missing in ("attention over the QSA selection", "PLE layer", "MTP", "decoder layer"):
        assert missing in str(error.value)
    for ok in ("npqwen/hyper_connections.py", "npqwen/ple.py", "npqwen/qsa.py"):
        assert ok in str(error.value)


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
