"""Qwen4-Exp (model_type "qwen4_exp"): the parts npqwen has, each checked against transformers' own module on a
tiny random config (hyper-connection mixing, PLE's n-gram hashing and lookup), and the refusal that names what
npqwen does not have yet (QSA, the PLE layer's convolution, the gated shared expert, MTP, the decoder layer)."""
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
    for missing in ("QSA", "PLE layer", "gated shared expert", "MTP"):
        assert missing in str(error.value)
    for ok in ("npqwen/hyper_connections.py", "npqwen/ple.py"):
        assert ok in str(error.value)
