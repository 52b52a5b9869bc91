"""Golden tests: npqwen's logits and per-layer hidden states equal HF transformers' in float32."""
import numpy as np
import pytest

import npqwen
from npqwen.backend import to_numpy

from conftest import DEVICES, QWEN3_0_6B, build_hf_checkpoint, hf_model, tiny_config
from tolerance import EPS32, model_tolerance, relative_diff

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# name -> (config overrides, saved dtype, sharded, prompt length)
CASES = {
    "tiny-gqa2-bf16-tied": (dict(), "bfloat16", False, 40),
    "gqa1-f32-untied-sharded": (dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                     tie_word_embeddings=False), "float32", True, 33),
    "gqa4-bf16-untied-sharded": (dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False), "bfloat16", True, 33),
    "gqa2-f16-untied": (dict(tie_word_embeddings=False), "float16", False, 17),
    "yarn-bf16": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                       max_position_embeddings=256), "bfloat16", False, 150),
    "linear-rope-f32": (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "float32", False, 70),
}


def compare(llm, ref, ids, device="cpu"):
    """Logits and hidden states of npqwen vs HF on `ids`; returns a report line and asserts the tolerances."""
    recorded = {}
    logits = to_numpy(llm.forward(ids, recorder=lambda name, a: recorded.__setitem__(name, to_numpy(a).copy())))
    with torch.no_grad():
        out = ref(torch.tensor(np.asarray(ids))[None], output_hidden_states=True)
    want = out.logits[0].numpy()
    diff = np.abs(logits - want)
    rel, tolerance = relative_diff(logits, want), model_tolerance(llm.config, len(ids))
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    report = (f"max |logit diff| {diff.max():.3e} (relative {rel:.2e}, tolerance {tolerance:.1e}), argmax mismatches "
              f"at positions {mismatch[:10].tolist()} (of {len(ids)})")
    print(report)
    assert logits.dtype == llm.model.dtype and logits.shape == want.shape
    assert rel <= tolerance, report
    assert mismatch.size == 0, report
    # HF's hidden_states: the embeddings, layers 0 .. L-2 outputs, then the final norm output.
    L = llm.config.num_hidden_layers
    names = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(L - 1)] + ["model.norm"]
    for layers, (name, h) in enumerate(zip(names, out.hidden_states, strict=True)):
        h = h[0].numpy()
        err, bound = relative_diff(recorded[name], h), model_tolerance(llm.config, len(ids), min(layers, L))
        print(f"  {name}: relative max |diff| {err:.2e} (tolerance {bound:.1e})")
        assert err <= bound, f"{name}: relative max |diff| {err:.3e} vs HF (tolerance {bound:.1e})"   # embedding: exact
    return diff.max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case, device, tmp_path):
    overrides, save_dtype, shard, T = CASES[case]
    path = build_hf_checkpoint(tmp_path, tiny_config(**overrides), save_dtype=save_dtype, shard=shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    llm = npqwen.load(path, device=device)
    ids = np.random.default_rng(1).integers(0, llm.config.vocab_size, size=T)
    compare(llm, hf_model(path), ids, device)


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_0_6b_shape_matches_hf(qwen3_0_6b_shape, device):
    llm = npqwen.load(qwen3_0_6b_shape, device=device)
    assert sum(a.size for n, a in llm.weights.items() if n != "lm_head.weight") == 596_049_920
    assert llm.weights["lm_head.weight"] is llm.weights["model.embed_tokens.weight"]
    ids = np.random.default_rng(2).integers(0, 151_643, size=24)
    compare(llm, hf_model(qwen3_0_6b_shape), ids, device)


def test_rope_frequencies_equal_hf(tmp_path):
    """inv_freq and the YaRN attention factor computed without torch equal transformers' own."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from npqwen.ops import rope_frequencies

    for scaling in (None, {"rope_type": "linear", "factor": 4.0},
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}):
        raw = dict(QWEN3_0_6B, rope_scaling=scaling, max_position_embeddings=131072)
        ours, scale = rope_frequencies(npqwen.Qwen3Config.from_dict(raw))
        cfg = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "torch_dtype")}
        hf = Qwen3RotaryEmbedding(Qwen3Config(**cfg))
        err = np.abs(ours - hf.inv_freq.numpy()).max() / np.abs(hf.inv_freq.numpy()).max()
        print(scaling, "relative inv_freq diff", err, "scale", scale, hf.attention_scaling)
        assert err <= 2 * EPS32 and ours.dtype == np.float32   # a power (and YaRN's blend), each rounded once to float32
        assert scale == pytest.approx(hf.attention_scaling, rel=1e-12)
