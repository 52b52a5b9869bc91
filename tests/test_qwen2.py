"""Qwen2 / Qwen2.5 ("qwen2"): Qwen3 without QK-norm and with biases on q, k and v. Golden against transformers'
Qwen2ForCausalLM (float32 logits within 1e-4 relative, greedy tokens equal) at small configs and at Qwen2.5-0.5B's
layer shape; then the engine (batched = alone, chunked, preempted, prefix hits), trace / hooks / compare, the
lens, PEFT LoRA on q/k/v (which carry the biases), the tensor-parallel split of the biases, and the errors."""
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
TINY_QWEN2 = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=True)
# Qwen/Qwen2.5-0.5B's config.json (24 layers: D=896, 14/2 heads of 64, F=4864, tied), with num_hidden_layers set
QWEN2_5_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                    tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
                    bos_token_id=151643, eos_token_id=151643, hidden_act="silu")


def build_qwen2(path, save_dtype="float32", seed=0, std=0.1, **overrides):
    """A random checkpoint written by transformers' Qwen2ForCausalLM; norms 1 + noise, biases as large as weights."""
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**TINY_QWEN2, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, std)
    model.to(getattr(torch, save_dtype)).save_pretrained(path)
    return path


def hf_qwen2(path):
    return transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def golden(llm, ref, ids, what):
    """npqwen's logits vs HF's float32 ones: relative max |diff| and argmax mismatches, printed and checked."""
    logits = llm.forward(ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    rel = float(np.abs(logits - want).max() / np.abs(want).max())
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    print(f"{what}: max |logit diff| {np.abs(logits - want).max():.3e}, relative {rel:.3e}, argmax mismatches "
          f"{mismatch[:10].tolist()} of {len(ids)}")
    assert rel <= REL_TOL and mismatch.size == 0


CASES = {   # name -> (config overrides, saved dtype, prompt length)
    "tied-f32": (dict(), "float32", 70),
    "untied-bf16-kv1": (dict(tie_word_embeddings=False, num_key_value_heads=1), "bfloat16", 90),
    "H6-K2-Dh16-yarn": (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                              "original_max_position_embeddings": 256}), "float32", 300),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case, tmp_path):
    overrides, save_dtype, T = CASES[case]
    path = build_qwen2(tmp_path, save_dtype, **overrides)
    llm, ref = npqwen.load(path), hf_qwen2(path)
    assert llm.config.model_type == "qwen2" and llm.config.attention_bias and not llm.config.qk_norm
    assert "model.layers.0.self_attn.q_proj.bias" in llm.weights and not any("q_norm" in n for n in llm.weights)
    golden(llm, ref, np.random.default_rng(0).integers(0, llm.config.vocab_size, T).tolist(), case)


def test_greedy_equals_hf_and_a_saved_copy_reads_back_in_hf(tmp_path):
    path = build_qwen2(tmp_path / "hf", std=0.3, tie_word_embeddings=False)
    llm, ref = npqwen.load(path), hf_qwen2(path)
    prompt = np.random.default_rng(1).integers(0, 512, 40).tolist()
    got, want = greedy_both(llm, ref, prompt, 20)
    assert got == want and len(set(got)) > 3
    saved = llm.save(tmp_path / "saved")   # npqwen's writer: config.json says Qwen2ForCausalLM, HF reads it
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    golden(llm, hf_qwen2(saved), prompt, "saved by npqwen, read by HF")


@pytest.mark.skipif(free_memory_bytes(np) < 1 * 2**30, reason="Qwen2.5-0.5B's layer shape with 2 layers needs "
                    "~0.5 GiB free (in HF and in npqwen)")
def test_qwen2_5_0_5b_layer_shape(tmp_path):
    """Qwen2.5-0.5B's layers exactly (D=896, 14/2 heads of 64, F=4864, tied, rope_theta 1e6), its first 2; the
    vocabulary cut to 8,192 (the whole 151,936 rows only make the test 4x slower; the golden test at the full
    vocabulary ran once: relative 1.5e-6, greedy equal)."""
    path = build_qwen2(tmp_path, "bfloat16", std=0.02, **{**QWEN2_5_0_5B, "vocab_size": 8192}, num_hidden_layers=2)
    llm, ref = npqwen.load(path), hf_qwen2(path)
    assert (llm.config.head_dim, llm.model.heads, llm.model.kv_heads) == (64, 14, 2)
    ids = np.random.default_rng(2).integers(0, 8192, 60).tolist()
    golden(llm, ref, ids, "Qwen2.5-0.5B shape, 2 layers")
    got, want = greedy_both(llm, ref, ids, 5)
    assert got == want


# ---------------------------------------------------------------------------- the engine, trace, hooks, lens

@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return build_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def qwen2_64(qwen2_dir):
    return npqwen.load(qwen2_dir, dtype="float64")


def test_engine_batched_chunked_preempted_and_prefix_hits_equal_alone(qwen2_64):
    ps = prompts([1, 5, 17, 64, 130], seed=3)
    reqs = [(p, dict(max_new_tokens=6, temperature=0)) for p in ps]
    engine = Engine(qwen2_64, kv_cache_tokens=16 * 64, page_size=16, max_batched_tokens=40, max_batch_size=3)
    for p, (tokens, logits, _) in zip(ps, run(engine, reqs, spy=True)):
        assert compare_runs(f"batched, chunked: prompt {len(p)}", tokens, logits, *alone(qwen2_64, p, 6)) <= 1e-10
    tight = Engine(qwen2_64, kv_cache_tokens=8 * 16, page_size=16)
    long = [(p, dict(max_new_tokens=40, temperature=0)) for p in prompts([30, 45, 20], seed=4)]
    squeezed = run(tight, long)
    roomy = run(Engine(qwen2_64, kv_cache_tokens=64 * 16, page_size=16), long)
    print("preemptions:", tight.stats["preemptions"])
    assert tight.stats["preemptions"] > 0 and [r[0] for r in squeezed] == [r[0] for r in roomy]
    shared = prompts([50], seed=5)[0]
    cached = Engine(qwen2_64, kv_cache_tokens=64 * 16, page_size=16)
    first = run(cached, [(shared + [7, 8], dict(max_new_tokens=5, temperature=0))])
    second = run(cached, [(shared + [9], dict(max_new_tokens=5, temperature=0))], spy=True)
    print("prefix cache hit tokens:", cached.stats["prefix_cache_hit_tokens"])
    assert first and cached.stats["prefix_cache_hit_tokens"] >= 48
    (tokens, logits, _), = second
    assert compare_runs("prefix hit", tokens, logits, *alone(qwen2_64, shared + [9], 5)) <= 1e-10


def test_trace_hooks_and_compare_name_no_qk_norm(qwen2_dir):
    from npqwen.compare import compare, relative
    from npqwen.hooks import step_names

    llm = npqwen.load(qwen2_dir)
    ids = prompts([20], seed=6)[0]
    logits, cache = llm.run_with_cache(ids)
    assert list(cache) == [n for n in step_names(llm.config) if n in cache] and "model.layers.0.self_attn.q_norm" \
        not in step_names(llm.config)
    # q_proj's output includes its bias: HF's module output
    bias = llm.weights["model.layers.0.self_attn.q_proj.bias"]
    x = cache["model.layers.0.input_layernorm"]
    W = llm.weights["model.layers.0.self_attn.q_proj.weight"]
    assert np.allclose(cache["model.layers.0.self_attn.q_proj"], x @ W.T + bias, atol=1e-5)
    zeroed = llm.run_with_hooks(ids, hooks={"model.layers.1.self_attn.k_proj": lambda a, name: a * 0})
    assert np.abs(zeroed - logits).max() > 1e-3
    with pytest.raises(NpqwenError, match="unknown hook name 'model.layers.0.self_attn.q_norm'"):
        llm.run_with_hooks(ids, hooks={"model.layers.0.self_attn.q_norm": lambda a, name: a})
    rows = compare(llm, ids)
    worst = max(rows, key=relative)
    print(f"compare: {len(rows)} steps, worst {worst['name']} {relative(worst):.2e}")
    assert all(r["ok"] for r in rows) and any(r["name"].endswith("self_attn.q_rope") for r in rows)


def test_lens_attribution_adds_up(qwen2_dir):
    llm = npqwen.load(qwen2_dir, dtype="float64")
    a = llm.logit_attribution(prompts([12], seed=7)[0], 5)
    total = a.embed + a.attn.sum() + a.mlp.sum()
    print(f"attribution: logit {a.logit:.6f}, shares {total:.6f}; heads vs layers "
          f"{np.abs(a.heads.sum(1) - a.attn).max():.1e}")
    assert abs(total - a.logit) < 1e-8 and np.allclose(a.heads.sum(1), a.attn)   # (o_proj has no bias in Qwen2)


def test_server_completion_equals_generate(tmp_path):
    pytest.importorskip("fastapi")
    from conftest import add_qwen3_tokenizer, needs_qwen3_tokenizer
    from serving import LiveServer, http_json

    needs_qwen3_tokenizer()   # Qwen2.5's vocabulary is Qwen3's (151,643 tokens and the same specials)
    path = add_qwen3_tokenizer(build_qwen2(tmp_path, std=0.2, vocab_size=151936, eos_token_id=151645))
    llm = npqwen.load(path)
    live = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=1024, page_size=16))
    try:
        body = dict(model="test-model", prompt="Qwen2.5 has biases on", temperature=0, max_tokens=8,
                    return_token_ids=True)
        status, out = http_json("POST", live.url + "/v1/completions", body)
        want = llm.generate("Qwen2.5 has biases on", max_new_tokens=8, temperature=0).token_ids
        assert status == 200, out
        print("server", out["choices"][0]["token_ids"], "generate", want)
        assert status == 200 and out["choices"][0]["token_ids"] == want
    finally:
        live.close()


# ---------------------------------------------------------------------------- LoRA, tensor parallelism

def test_peft_lora_on_q_k_v_with_biases_equals_peft(qwen2_dir, tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(hf_qwen2(qwen2_dir), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                    target_modules=["q_proj", "k_proj", "v_proj",
                                                                                    "o_proj", "down_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    llm = npqwen.load(qwen2_dir, lora={"a": tmp_path / "adapter"})
    ids = prompts([30], seed=8)[0]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = llm.forward(ids, lora="a")
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"LoRA vs PEFT: relative max |diff| {rel:.2e}; vs the base {np.abs(got - llm.forward(ids)).max():.2e}")
    assert rel <= REL_TOL and np.abs(got - llm.forward(ids)).max() > 1e-3


def test_tensor_parallel_splits_the_biases_with_their_rows(qwen2_dir, tmp_path):
    from npqwen.checkpoint import expected_shapes
    from npqwen.parallel import shards

    config = npqwen.load(qwen2_dir).config
    parts = shards(config, expected_shapes(config), 2, 1)   # rank 1 of 2: query heads 2, 3; key/value head 1
    assert parts["model.layers.0.self_attn.q_proj.bias"] == (slice(32, 64),)
    assert parts["model.layers.0.self_attn.k_proj.bias"] == parts["model.layers.0.self_attn.v_proj.bias"] == \
        (slice(16, 32),)
    pytest.importorskip("mpi4py")
    from test_parallel import assert_same, probe

    one = probe(qwen2_dir, tmp_path / "one", 0, "--lengths", "1,37")[0]
    ranks = probe(qwen2_dir, tmp_path / "tp", 2, "--lengths", "1,37")
    assert_same(one, ranks, npqwen.load(qwen2_dir).config)   # tests/tolerance.py's bar for this model


# ---------------------------------------------------------------------------- errors

def test_a_family_mismatch_and_sliding_windows_are_named(qwen2_dir, tmp_path):
    import shutil

    wrong = tmp_path / "as_qwen3"
    shutil.copytree(qwen2_dir, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    with pytest.raises(NpqwenError, match="QK-norm.*model_type 'qwen2'"):
        npqwen.load(wrong)
    (wrong / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(NpqwenError, match="sliding-window attention is unsupported"):
        npqwen.load(wrong)
    (wrong / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_moe"}))
    with pytest.raises(NpqwenError, match="model_type is 'qwen2_moe'"):
        npqwen.load(wrong)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:xdist", "-s", f"--rootdir={ROOT}"]))
