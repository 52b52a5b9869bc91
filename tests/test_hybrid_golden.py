"""Golden tests for Qwen3.5: npqwen's logits equal HF transformers' float32 within 1e-4 (relative) on random
checkpoints (Qwen3_5ForCausalLM and the hub's Qwen3_5ForConditionalGeneration layout), at small shapes and at
Qwen3.5-0.8B's text shape; greedy generation equals HF's."""
import json

import numpy as np
import pytest

import npqwen

from hybrid_checkpoints import (QWEN3_5_0_8B_TEXT, QWEN3_5_35B_A3B_TEXT, build_hybrid_checkpoint, hf_hybrid_model,
                                hybrid_config, hybrid_moe_config, qwen3_next_config)
from npqwen.backend import free_memory_bytes

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REL_TOL = 1e-4
L, F = "linear_attention", "full_attention"

# name -> (config overrides, saved dtype, hub layout, prompt length)
CASES = {
    "3:1-tied-f32": (dict(), "float32", False, 70),
    "kv1-untied-bf16-FLLFL": (dict(num_key_value_heads=1, tie_word_embeddings=False, num_hidden_layers=5,
                                   layer_types=[F, L, L, F, L]), "bfloat16", False, 150),
    "H6-K2-Hv=Hk-1:1": (dict(num_attention_heads=6, num_key_value_heads=2, linear_num_key_heads=4,
                             linear_num_value_heads=4, num_hidden_layers=2, layer_types=[L, F]), "float32", False, 65),
    "all-linear": (dict(num_hidden_layers=2, layer_types=[L, L]), "float32", False, 40),
    "hub-layout-untied": (dict(tie_word_embeddings=False), "float32", True, 70),
    "moe-shared-expert": (dict(model_type="qwen3_5_moe_text"), "float32", False, 70),
    "moe-hub-layout-FL": (dict(model_type="qwen3_5_moe_text", num_hidden_layers=2, layer_types=[F, L]),
                          "bfloat16", True, 40),
    "qwen3-next-dense-layer1": (dict(model_type="qwen3_next"), "float32", False, 70),
    "qwen3-next-H6-Hk1-LF": (dict(model_type="qwen3_next", num_attention_heads=6, linear_num_key_heads=1,
                                  num_hidden_layers=2, layer_types=[L, F], tie_word_embeddings=False),
                             "bfloat16", False, 40),
}
BUILD = {"qwen3_5_text": hybrid_config, "qwen3_5_moe_text": hybrid_moe_config, "qwen3_next": qwen3_next_config}


def compare(llm, ref, ids):
    """npqwen's logits and hidden states vs HF's on `ids`; prints and returns the relative logit difference."""
    recorded = {}
    logits = llm.forward(ids, recorder=lambda name, a: recorded.__setitem__(name, np.array(a)))
    with torch.no_grad():
        out = ref(torch.tensor(np.asarray(ids))[None], output_hidden_states=True, use_cache=False)
    want = out.logits[0].numpy()
    rel = np.abs(logits - want).max() / np.abs(want).max()
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    print(f"max |logit diff| {np.abs(logits - want).max():.3e}, relative {rel:.3e}, argmax mismatches "
          f"{mismatch[:10].tolist()} of {len(ids)}")
    names = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(llm.config.num_hidden_layers - 1)]
    for name, h in zip(names, out.hidden_states):
        h = h[0].numpy()
        err = np.abs(recorded[name] - h).max() / max(1.0, np.abs(h).max())
        assert err <= REL_TOL, f"{name}: relative max |diff| {err:.3e} vs HF"
    assert rel <= REL_TOL and mismatch.size == 0
    return rel


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case, tmp_path):
    overrides, save_dtype, hub, T = CASES[case]
    config = BUILD[overrides.get("model_type", "qwen3_5_text")](**overrides)
    path = build_hybrid_checkpoint(tmp_path, config, save_dtype=save_dtype, hub_layout=hub)
    llm, ref = npqwen.load(path), hf_hybrid_model(path)
    ids = np.random.default_rng(0).integers(0, llm.config.vocab_size, T).tolist()
    print(f"{case}:", end=" ")
    compare(llm, ref, ids)


def test_hub_layout_reads_the_text_model_only(tmp_path):
    path = build_hybrid_checkpoint(tmp_path, hybrid_config(), hub_layout=True)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    llm = npqwen.load(path)
    assert llm.config.hybrid and not any("visual" in n or n.startswith("mtp") for n in llm.model.weights)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in llm.model.weights


def test_greedy_generation_equals_hf(tmp_path):
    path = build_hybrid_checkpoint(tmp_path, hybrid_config(num_hidden_layers=5, layer_types=[L, F, L, L, F]), std=0.1)
    llm, ref = npqwen.load(path), hf_hybrid_model(path)
    prompt = np.random.default_rng(1).integers(0, 512, 90).tolist()
    got = llm.generate(prompt, max_new_tokens=24, temperature=0).token_ids
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    print(f"greedy: npqwen {got[:8]}... HF {want[:8]}...; first mismatch "
          f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)}")
    assert got == want


def test_qwen3_5_0_8b_text_shape(tmp_path):
    """Qwen3.5-0.8B's text model exactly (hidden 1024, 8/2 heads of 256, 16/16 linear heads of 128, vocabulary
    248,320, rope_theta 1e7, partial rotary 0.25, mrope_section [11, 11, 10]), its first 4 layers (3 linear, 1 full)."""
    config = {"model_type": "qwen3_5_text", **QWEN3_5_0_8B_TEXT, "num_hidden_layers": 4}
    path = build_hybrid_checkpoint(tmp_path, config, save_dtype="bfloat16", std=0.02)
    llm, ref = npqwen.load(path), hf_hybrid_model(path)
    assert llm.config.rotary_dim == 64 and llm.config.layer_types == (L, L, L, F)
    ids = np.random.default_rng(2).integers(0, 248044, 100).tolist()
    print("Qwen3.5-0.8B text shape, 4 layers:", end=" ")
    compare(llm, ref, ids)


@pytest.mark.skipif(free_memory_bytes(np) < 24 * 2**30, reason="the 35B-A3B layer shape needs ~24 GiB free "
                    "(2 layers of 256 experts: 1.6 billion parameters, in HF and in npqwen)")
def test_qwen3_5_35b_a3b_layer_shape(tmp_path):
    """Qwen3.5-35B-A3B's layers exactly (hidden 2048, 16/2 heads of 256, 16/32 linear heads of 128, 256 experts of
    512, 8 per token, a shared expert of 512), two of them (linear, full); its vocabulary cut to 4,096."""
    config = {"model_type": "qwen3_5_moe_text", **QWEN3_5_35B_A3B_TEXT, "num_hidden_layers": 2, "vocab_size": 4096,
              "layer_types": [L, F]}
    path = build_hybrid_checkpoint(tmp_path, config, save_dtype="bfloat16", std=0.02)
    llm, ref = npqwen.load(path), hf_hybrid_model(path)
    ids = np.random.default_rng(3).integers(0, 4096, 40).tolist()
    print("Qwen3.5-35B-A3B layer shape, 2 layers:", end=" ")
    compare(llm, ref, ids)


def test_built_in_tiny_qwen3_5_equals_hf(tmp_path):
    """The built-in `tiny-qwen3.5` (npqwen/tiny.py), saved by llm.save and read by transformers: the same logits,
    over a prompt of two chunks; its layers are 3 linear + 1 full attention, and its norms' weights lie around 0."""
    llm = npqwen.load("tiny-qwen3.5")
    assert llm.config.layer_types == (L, L, L, F) and abs(llm.weights["model.norm.weight"].mean()) < 0.1
    ids = llm.tokenizer.encode("A built-in hybrid reads a prompt longer than one chunk of 64 tokens. " * 2)
    assert len(ids) > 64
    print("tiny-qwen3.5:", end=" ")
    compare(llm, hf_hybrid_model(llm.save(tmp_path)), ids)


def test_built_in_tiny_qwen3_5_on_the_command_line():
    """`--model tiny-qwen3.5` is listed in --help, and generate and trace run it."""
    from test_cli import run

    code, out, err = run("generate", "--help")
    assert code == 0 and "'tiny-qwen3.5'" in " ".join(out.split()), out
    code, out, err = run("generate", "--model", "tiny-qwen3.5", "--raw", "--prompt", "Hi", "-t", "0", "-n", "6")
    assert code == 0 and "generation: 6 tokens" in err, err
    code, out, err = run("trace", "--model", "tiny-qwen3.5", "--prompt", "Hybrid", "--layers", "0")
    assert code == 0 and "model.layers.0.linear_attn.core_attn_out" in out, out + err
