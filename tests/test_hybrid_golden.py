"""Golden tests for Qwen3.5: npqwen's logits equal HF transformers' float32 within rounding (tests/tolerance.py) on random
checkpoints (Qwen3_5ForCausalLM and the hub's Qwen3_5ForConditionalGeneration layout), at small shapes and at
Qwen3.5-0.8B's text shape; greedy generation equals HF's."""
import json

import numpy as np
import pytest

import npqwen

from conftest import greedy_both
from hybrid_checkpoints import (QWEN3_5_0_8B_TEXT, QWEN3_5_35B_A3B_TEXT, build_hybrid_checkpoint, hf_hybrid_model,
                                hybrid_config, hybrid_moe_config, qwen3_next_config)
from npqwen.backend import free_memory_bytes
from tolerance import model_tolerance, relative_diff

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

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
    rel, tolerance = relative_diff(logits, want), model_tolerance(llm.config, len(ids))
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    print(f"max |logit diff| {np.abs(logits - want).max():.3e}, relative {rel:.3e} (tolerance {tolerance:.1e}), "
          f"argmax mismatches {mismatch[:10].tolist()} of {len(ids)}")
    names = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(llm.config.num_hidden_layers - 1)]
    for layers, (name, h) in enumerate(zip(names, out.hidden_states)):   # the embedding (0 layers): exact
        err, bound = relative_diff(recorded[name], h[0].numpy()), model_tolerance(llm.config, len(ids), layers)
        assert err <= bound, f"{name}: relative max |diff| {err:.3e} vs HF (tolerance {bound:.1e})"
    assert rel <= tolerance and mismatch.size == 0
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


@pytest.mark.parametrize("top, text", [(None, True), (True, False)])
def test_hub_layout_ties_lm_head_as_its_top_level_config_says(top, text, tmp_path):
    """In the hub layout (Qwen3_5ForConditionalGeneration) transformers ties lm_head by the top-level config's
    tie_word_embeddings (PreTrainedModel.get_expanded_tied_weights_keys reads the model's own config, and
    Qwen3_5Config's default is False), whatever text_config says; Qwen3_5ForCausalLM's config is its own (the
    text layout's cases above). Left out at the top (as HF writes from a Qwen3_5Config given only a tied
    text_config): untied, lm_head.weight stored and used; True at the top over an untied text_config: tied."""
    from safetensors import safe_open

    path = build_hybrid_checkpoint(tmp_path, hybrid_config(tie_word_embeddings=text), hub_layout=True,
                                   top_level={} if top is None else {"tie_word_embeddings": top})
    saved = json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "np") as f:
        stored = "lm_head.weight" in f.keys()
    print(f"top-level {saved['tie_word_embeddings']}, text_config {saved['text_config']['tie_word_embeddings']}, "
          f"lm_head.weight stored: {stored}")
    assert (saved["tie_word_embeddings"], saved["text_config"]["tie_word_embeddings"], stored) == \
        (bool(top), text, not top)
    llm, ref = npqwen.load(path), hf_hybrid_model(path)
    assert llm.config.tie_word_embeddings == bool(top)
    assert (ref.lm_head.weight.data_ptr() == ref.model.language_model.embed_tokens.weight.data_ptr()) == bool(top)
    compare(llm, ref, np.random.default_rng(1).integers(0, llm.config.vocab_size, 40).tolist())


def test_greedy_generation_equals_hf(tmp_path):
    path = build_hybrid_checkpoint(tmp_path, hybrid_config(num_hidden_layers=5, layer_types=[L, F, L, L, F]), std=0.1)
    llm, ref = npqwen.load(path), hf_hybrid_model(path)
    prompt = np.random.default_rng(1).integers(0, 512, 90).tolist()
    got, want = greedy_both(llm, ref, prompt, 24)
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


A3B_IDS = np.random.default_rng(3).integers(0, 4096, 40).tolist()
A3B_NEW_TOKENS = 6


def write_35b_a3b_checkpoint_and_hf_answers(path):
    """Run in a process of its own by test_qwen3_5_35b_a3b_layer_shape: transformers writes a random 2-layer
    checkpoint of Qwen3.5-35B-A3B's layer shape (bf16, 3.3 GB) and, in float32, its logits, hidden states and
    greedy tokens for A3B_IDS into hf_answers.npz. The process then exits, so HF's 6.6 GB go back to the OS
    before npqwen loads its own."""
    from pathlib import Path

    from transformers.initialization import no_init_weights

    from hybrid_checkpoints import hf_hybrid_classes, randomize

    path = Path(path)
    cfg = {k: v for k, v in QWEN3_5_35B_A3B_TEXT.items()}
    cfg.update(num_hidden_layers=2, vocab_size=4096, layer_types=[L, F])
    config_class, model_class = hf_hybrid_classes("qwen3_5_moe_text")
    torch.set_default_dtype(torch.bfloat16)   # made in bf16, as saved: half the memory
    with no_init_weights():                    # random weights below; HF's own initialisation would double the time
        model = model_class(config_class(**cfg))
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():                      # no_init_weights left the decay's parameters empty: HF's initial values
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
    randomize(model, seed=0, std=0.02)
    model.save_pretrained(path)
    ref = model.float().eval()   # bf16 -> float32 is exact: the float32 model HF loads from these files
    with torch.no_grad():
        out = ref(torch.tensor([A3B_IDS]), output_hidden_states=True, use_cache=False)
        greedy = ref.generate(torch.tensor([A3B_IDS]), max_new_tokens=A3B_NEW_TOKENS, do_sample=False,
                              min_new_tokens=A3B_NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    np.savez(path / "hf_answers.npz", logits=out.logits[0].numpy(), greedy=greedy[0, len(A3B_IDS):].numpy(),
             **{f"hidden.{i}": h[0].numpy() for i, h in enumerate(out.hidden_states)})


@pytest.mark.skipif(free_memory_bytes(np) < 14 * 2**30, reason="the 35B-A3B layer shape needs ~14 GiB free "
                    "(2 layers of 256 experts: 1.6 billion parameters, in HF's process, then in npqwen)")
def test_qwen3_5_35b_a3b_layer_shape(tmp_path):
    """Qwen3.5-35B-A3B's layers exactly (hidden 2048, 16/2 heads of 256, 16/32 linear heads of 128, 256 experts of
    512, 8 per token, a shared expert of 512), two of them (linear, full); its vocabulary cut to 4,096. HF runs in a
    subprocess that exits before npqwen loads, so the two never hold their 6.6 GB at once."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    here, started = Path(__file__).parent, time.perf_counter()
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import test_hybrid_golden; "
            f"test_hybrid_golden.write_35b_a3b_checkpoint_and_hf_answers(sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = dict(np.load(tmp_path / "hf_answers.npz"))
    hf_seconds = time.perf_counter() - started
    llm = npqwen.load(tmp_path)
    assert llm.config.num_experts == 256 and llm.config.layer_types == (L, F)
    recorded = {}
    logits = llm.forward(A3B_IDS, recorder=lambda name, a: recorded.__setitem__(name, np.array(a)))
    want = answers["logits"]
    rel, tolerance = relative_diff(logits, want), model_tolerance(llm.config, len(A3B_IDS))
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    print(f"Qwen3.5-35B-A3B layer shape, 2 layers: max |logit diff| {np.abs(logits - want).max():.3e}, relative "
          f"{rel:.3e} (tolerance {tolerance:.1e}), argmax mismatches {mismatch[:10].tolist()} of {len(A3B_IDS)}")
    for layers, name in enumerate(["model.embed_tokens", "model.layers.0"]):   # the embedding (0 layers): exact
        err, bound = relative_diff(recorded[name], answers[f"hidden.{layers}"]), model_tolerance(llm.config, len(A3B_IDS), layers)
        assert err <= bound, f"{name}: relative max |diff| {err:.3e} vs HF (tolerance {bound:.1e})"
    assert rel <= tolerance and mismatch.size == 0
    got = llm.generate(A3B_IDS, max_new_tokens=A3B_NEW_TOKENS, temperature=0).token_ids
    print(f"greedy: npqwen {got}, HF {answers['greedy'].tolist()}; HF's process {hf_seconds:.0f} s, in all "
          f"{time.perf_counter() - started:.0f} s")
    assert got == answers["greedy"].tolist()


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
