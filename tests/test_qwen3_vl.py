"""Qwen3-VL's language model (model_type "qwen3_vl" / "qwen3_vl_moe" and their "_text" configs), read from the hub's
Qwen3VL(Moe)ForConditionalGeneration layout for its text part. For text alone its multimodal RoPE has its three
position streams equal, which is plain RoPE: HF's float32 logits on text-only input within 1e-4 relative and its
greedy tokens, dense and MoE (experts stored as transformers holds them, and transposed as the hub's files do);
the engine, LoRA on the text model, the tensor-parallel split, and the refusals (a malformed mrope_section, an
adapter on the vision tower, an image in a request, tensor parallelism over the stored expert tensors)."""
import json
import sys

import numpy as np
import pytest

import npqwen
from npqwen import Engine
from npqwen.backend import free_memory_bytes
from npqwen.errors import NpqwenError

from conftest import ROOT, greedy_both
from test_engine import alone, compare as compare_runs, prompts, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5],
                             "mrope_interleaved": True})
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              deepstack_visual_indexes=[0], num_position_embeddings=16)
# Qwen/Qwen3-VL-2B-Instruct's text_config (28 layers: D=2048, 16/8 heads of 128, F=6144, tied, mrope [24, 20, 20])
QWEN3_VL_2B_TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000000, "mrope_section": [24, 20, 20],
                                         "mrope_interleaved": True}, tie_word_embeddings=True)


def build_vl(path, moe=False, tied=False, seed=0, std=0.1, transpose_experts=False, **text):
    """A random Qwen3VL(Moe)ForConditionalGeneration (a one-block vision tower beside the text model), saved by
    transformers; with transpose_experts the experts rewritten as the hub's files hold them, (E, D, 2I), (E, I, D)."""
    config_class, model_class = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration)
                                 if moe else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    text = {**TEXT, **(MOE if moe else {}), "tie_word_embeddings": tied, **text}   # (HF ties by the outer value)
    torch.manual_seed(seed)
    model = model_class(config_class(text_config=text, vision_config=VISION, tie_word_embeddings=tied))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, std)
    model.save_pretrained(path)
    if transpose_experts:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        tensors = {k: np.ascontiguousarray(v.transpose(0, 2, 1)) if ".mlp.experts." in k else v
                   for k, v in tensors.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, model.eval()


def golden(llm, ref, ids, what):
    logits = llm.forward(ids)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    rel = float(np.abs(logits - want).max() / np.abs(want).max())
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    print(f"{what}: max |logit diff| {np.abs(logits - want).max():.3e}, relative {rel:.3e}, argmax mismatches "
          f"{mismatch[:10].tolist()} of {len(ids)}")
    assert rel <= REL_TOL and mismatch.size == 0


CASES = {   # name -> build_vl arguments, prompt length
    "dense-untied": (dict(), 80),
    "dense-tied-H6-K1": (dict(tied=True, num_attention_heads=6, num_key_value_heads=1, hidden_size=96,
                              head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                             "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
                         60),
    "text-config-says-tied-outer-untied": (dict(tie_word_embeddings=True), 40),   # HF goes by the outer one
    "moe-as-transformers-holds-them": (dict(moe=True), 70),
    "moe-hub-transposed-sparse-step-2": (dict(moe=True, transpose_experts=True, decoder_sparse_step=2,
                                              num_hidden_layers=4), 70),
}


@pytest.mark.parametrize("case", CASES)
def test_text_logits_match_hf(case, tmp_path):
    kwargs, T = CASES[case]
    path, ref = build_vl(tmp_path, **kwargs)
    assert json.loads((path / "config.json").read_text())["model_type"] in ("qwen3_vl", "qwen3_vl_moe")
    llm = npqwen.load(path)
    assert not any("visual" in n for n in llm.weights) and llm.config.qk_norm
    golden(llm, ref, np.random.default_rng(0).integers(0, llm.config.vocab_size, T).tolist(), case)


def test_greedy_equals_hf(tmp_path):
    path, ref = build_vl(tmp_path, moe=True, std=0.3)
    llm = npqwen.load(path)
    prompt = np.random.default_rng(1).integers(0, 512, 30).tolist()
    got, want = greedy_both(llm, ref, prompt, 16)
    assert got == want and len(set(got)) > 3


@pytest.mark.skipif(free_memory_bytes(np) < 2 * 2**30, reason="Qwen3-VL-2B's text layers need ~1.2 GiB (2 layers "
                    "of D=2048 in HF and in npqwen)")
def test_qwen3_vl_2b_text_layer_shape(tmp_path):
    """Qwen3-VL-2B's text layers exactly (D=2048, 16/8 heads of 128, F=6144, mrope_section [24, 20, 20], rope_theta
    5e6), two of them; the vocabulary cut to 8,192 (the full 151,936 x 2048 embedding would need 2.5 GB in each)."""
    path, ref = build_vl(tmp_path, tied=True, std=0.02, **{**QWEN3_VL_2B_TEXT, "vocab_size": 8192,
                                                           "num_hidden_layers": 2})
    llm = npqwen.load(path)
    assert (llm.config.head_dim, llm.model.heads, llm.model.kv_heads, llm.config.rope_theta) == (128, 16, 8, 5e6)
    golden(llm, ref, np.random.default_rng(2).integers(0, 8192, 60).tolist(), "Qwen3-VL-2B text shape, 2 layers")


def test_engine_batched_chunked_and_prefix_hits_equal_alone(tmp_path):
    path, _ = build_vl(tmp_path, moe=True)
    llm = npqwen.load(path, dtype="float64")
    ps = prompts([3, 40, 90], seed=3)
    engine = Engine(llm, kv_cache_tokens=16 * 32, page_size=16, max_batched_tokens=32)
    for p, (tokens, logits, _) in zip(ps, run(engine, [(p, dict(max_new_tokens=5, temperature=0)) for p in ps],
                                               spy=True)):
        assert compare_runs(f"batched, chunked: prompt {len(p)}", tokens, logits, *alone(llm, p, 5)) <= 1e-10
    (tokens, logits, _), = run(engine, [(ps[2][:64] + [1], dict(max_new_tokens=5, temperature=0))], spy=True)
    print("prefix cache hit tokens:", engine.stats["prefix_cache_hit_tokens"])
    assert engine.stats["prefix_cache_hit_tokens"] >= 48
    assert compare_runs("prefix hit", tokens, logits, *alone(llm, ps[2][:64] + [1], 5)) <= 1e-10


def test_lora_on_the_text_model_equals_peft_and_the_vision_tower_is_refused(tmp_path):
    peft = pytest.importorskip("peft")
    path, ref = build_vl(tmp_path / "base")
    torch.manual_seed(0)
    model = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                     target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    model.save_pretrained(tmp_path / "text")
    llm = npqwen.load(path, lora={"text": tmp_path / "text"})
    ids = prompts([25], seed=4)[0]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(llm.forward(ids, lora="text") - want).max() / np.abs(want).max()
    print(f"LoRA on the text model vs PEFT: relative {rel:.2e}")
    assert rel <= REL_TOL
    vision = peft.LoraConfig(r=2, target_modules=r".*visual.*\.qkv")   # the vision tower's attention
    model = peft.get_peft_model(build_vl(tmp_path / "base2")[1], vision)
    model.save_pretrained(tmp_path / "vision")
    with pytest.raises(NpqwenError, match="vision tower"):
        llm.load_lora("vision", tmp_path / "vision")


@pytest.mark.parametrize("fmt", ["bfloat16", "q8_0"])
def test_stacked_experts_run_compact(fmt, tmp_path, capsys):
    """Qwen3-VL-MoE's experts, stored transposed as the hub's files hold them, as compact weights: each expert's slab
    read, transposed and converted on its own; logits equal float32 on the dequantized weights (1e-5)."""
    from test_weights import assert_close, dequantized_twin

    path, _ = build_vl(tmp_path, moe=True, transpose_experts=True)
    llm = npqwen.load(path, weights=fmt)
    expert = llm.model.weights["model.layers.1.mlp.experts.7.gate_proj.weight"]   # (not a name the file stores)
    assert expert.format.lower() == fmt and expert.shape == (16, 64)
    ids = np.random.default_rng(0).integers(0, 512, 40).tolist()
    assert_close(llm.forward(ids), dequantized_twin(llm).forward(ids), 1e-5, f"qwen3_vl_moe {fmt}")
    if fmt == "q8_0":   # writing them back in the hub's layout is not done: one line says so
        from npqwen.cli import main
        from test_cli import one_error_line

        capsys.readouterr()
        code = main(["quantize", str(path), str(tmp_path / "out"), "--to", fmt])
        one_error_line(code, capsys.readouterr().err, "does not write Qwen3-VL-MoE's stacked expert tensors")


def test_tensor_parallel_dense_and_the_refusal_for_stored_experts(tmp_path):
    path, _ = build_vl(tmp_path / "moe", moe=True)
    with pytest.raises(NpqwenError, match="tensor parallelism does not split Qwen3-VL-MoE"):
        from npqwen.checkpoint import expected_shapes, load_weights
        from npqwen.parallel import shards

        config = npqwen.load(path).config
        load_weights(path, config, np, np.float32, shards(config, expected_shapes(config), 2, 0))
    pytest.importorskip("mpi4py")
    from test_parallel import assert_same, probe

    dense, _ = build_vl(tmp_path / "dense")
    one = probe(dense, tmp_path / "one", 0, "--lengths", "1,37")[0]
    ranks = probe(dense, tmp_path / "tp", 2, "--lengths", "1,37")
    assert_same(one, ranks, npqwen.load(dense).config)   # tests/tolerance.py's bar for this model


def test_a_malformed_mrope_section_and_an_image_are_named(tmp_path):
    path, _ = build_vl(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["rope_parameters"]["mrope_section"] = [8, 8, 8]   # 24 frequencies, but head_dim / 2 = 16
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NpqwenError, match=r"mrope_section \[8, 8, 8\].*head_dim / 2 = 16"):
        npqwen.load(path)
    pytest.importorskip("fastapi")
    from conftest import add_qwen3_tokenizer, needs_qwen3_tokenizer
    from serving import LiveServer, assert_image_refused

    needs_qwen3_tokenizer()
    path, _ = build_vl(tmp_path / "full_vocab", vocab_size=151936)
    llm = npqwen.load(add_qwen3_tokenizer(path))
    live = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=512, page_size=16))
    try:
        assert_image_refused(live.url)
    finally:
        live.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:xdist", "-s", f"--rootdir={ROOT}"]))


def test_npqwen_compare_maps_the_text_model(tmp_path):
    """npqwen compare loads Qwen3VL(Moe)ForConditionalGeneration and hooks its language model: every step within
    1e-3, and a corrupted k_proj in one layer is the first row named."""
    from npqwen.compare import compare, report

    path, _ = build_vl(tmp_path / "vl", moe=True)
    llm = npqwen.load(path)
    rows = compare(llm, [1, 5, 9, 33, 100, 7, 8])
    print(report(rows, 1e-3))
    assert len(rows) > 40 and all(r["ok"] for r in rows)
    assert any(r["name"] == "model.layers.2.mlp.experts" for r in rows)
    w = llm.model.weights["model.layers.1.self_attn.k_proj.weight"]
    w[-4:] *= -1
    first = next(r for r in compare(llm, [1, 5, 9, 33, 100, 7, 8]) if not r["ok"])
    assert first["name"].startswith("model.layers.1.self_attn.k_proj"), first
