"""Real GGUF files from llama.cpp itself (node-llama-cpp 3.21.1: its convert_hf_to_gguf.py and quantizer, fetched by
tools/fetch_node_llama_cpp.sh), read by npqwen: the config, names and tokenizer equal the HF checkpoint's; the
logits equal npqwen's float32 on the weights gguf.quants.dequantize widens; and llama.cpp's own next-token
probabilities on the same Q8_0 file agree (top-1 on >= 95% of positions, KL < 1e-3). Skips, saying why, without
llama.cpp, node or the real Qwen3 tokenizer files."""
import shutil
import subprocess

import numpy as np
import pytest

import npqwen

pytest.importorskip("gguf", reason="the gguf package (pip install gguf) reads GGUF files")

from conftest import add_qwen3_tokenizer, build_hf_checkpoint, needs_qwen3_tokenizer, tiny_config  # noqa: E402
from gguf_helpers import (NODE_LLAMA_CPP, ROOT, convert_hf_to_gguf, llama_quantize, made_once,  # noqa: E402
                          needs_llama_cpp)
from test_gguf import assert_close, dequantized_reference  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. 日本語も少し。 def f(x):\n    return x ** 2\n<think>a</think>"
SAMPLES = [TEXT, "Hello, world!", "  two  spaces\tand a tab\n\n\nnewlines", "émigré naïve café", "🙂 emoji 🚀🚀",
           "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "don't won't I'll we've", "x" * 50]
# hidden 256 and head rows of 64: every matrix splits into whole k-quant super-blocks (256), as a real Qwen3's do
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=1, vocab_size=151936, eos_token_id=151645, bos_token_id=151643,
             max_position_embeddings=2048)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """An HF Qwen3 (float32, the real tokenizer) and llama.cpp's GGUF files of it: F32, Q8_0, Q4_K_M (made once)."""
    needs_llama_cpp()
    needs_qwen3_tokenizer()
    names = {"hf": "hf", "F32": "tiny-F32.gguf", "Q8_0": "tiny-Q8_0.gguf", "Q4_K_M": "tiny-Q4_K_M.gguf"}

    def make(work):
        hf = build_hf_checkpoint(work / "hf", tiny_config(**SHAPE), save_dtype="float32", std=0.05)
        add_qwen3_tokenizer(hf)
        convert_hf_to_gguf(hf, work / names["F32"])
        for ftype in ("Q8_0", "Q4_K_M"):
            llama_quantize(work / names["F32"], work / names[ftype], ftype)

    root = made_once(SHAPE, make, tmp_path_factory.mktemp("gguf_llama_cpp"))
    return {kind: root / name for kind, name in names.items()}


@pytest.fixture(scope="module")
def loaded(files):
    """Each file loaded once: npqwen.load of the HF directory and of each GGUF."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = npqwen.load(files[name])
        return cache[name]
    return get


def test_config_names_and_rows_are_the_hf_checkpoints(loaded):
    """F32: llama.cpp's names map back to HF's with no row permutation (npqwen's logits equal to the bit)."""
    gguf, hf = loaded("F32"), loaded("hf")
    assert gguf.config == hf.config
    ids = hf.tokenizer.encode(TEXT)
    np.testing.assert_array_equal(gguf.forward(ids), hf.forward(ids))
    for name, array in hf.weights.items():
        np.testing.assert_array_equal(np.asarray(gguf.weights[name]), array, err_msg=name)
    assert gguf.generate(ids, 12).token_ids == hf.generate(ids, 12).token_ids


def test_tokenizer_and_chat_template_from_the_gguf_equal_the_hf_files(loaded):
    gguf, hf = loaded("Q8_0"), loaded("hf")
    for text in SAMPLES:
        assert gguf.tokenizer.encode(text) == hf.tokenizer.encode(text), text
        ids = hf.tokenizer.encode(text)
        assert gguf.tokenizer.decode(ids) == hf.tokenizer.decode(ids) == text
    assert gguf.tokenizer.chat_template == hf.tokenizer.chat_template
    assert gguf.tokenizer.special_tokens["eos_token"] == "<|im_end|>" == hf.tokenizer.special_tokens["eos_token"]
    messages = [{"role": "user", "content": "Hi there"}]
    assert gguf.chat_prompt(messages) == hf.chat_prompt(messages)
    assert 151645 in gguf.eos_token_ids


@pytest.mark.parametrize("ftype, qtypes", [("Q8_0", {"Q8_0"}), ("Q4_K_M", {"Q4_K", "Q6_K"})])
def test_llama_cpp_files_equal_float32_on_the_dequantized_weights(files, loaded, ftype, qtypes):
    llm = loaded(ftype)
    formats = {w.format for w in llm.weights.values() if hasattr(w, "format")}
    assert qtypes <= formats, formats
    ref = dequantized_reference(files[ftype])
    ids = loaded("hf").tokenizer.encode(TEXT)
    assert_close(llm.forward(ids), ref.forward(ids), 1e-5, f"{ftype} logits")
    assert llm.generate(ids, 8).token_ids == ref.generate(ids, 8).token_ids


def llama_cpp_probs(path, ids, tmp_path) -> np.ndarray:
    """llama.cpp's next-token probabilities after each of `ids` (T, V), through node-llama-cpp."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: llama.cpp's logits are read through node-llama-cpp")
    out = tmp_path / "probs.f32"
    result = subprocess.run(["node", str(ROOT / "tests" / "llama_cpp_logprobs.mjs"), str(NODE_LLAMA_CPP), str(path),
                             str(out), *map(str, ids)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.fromfile(out, dtype="<f4").astype(np.float64).reshape(len(ids), -1)


# llama.cpp multiplies a Q8_0 matrix by activations it rounds to Q8_0 blocks too (npqwen keeps them float32). On this
# random model, whose next-token distribution is nearly flat (top probability ~2e-4), that can swap two near-tied
# top tokens: on a longer text (53 positions) 5 of 53 swapped (KL 1.6e-4); on this one none do.
def softmax(logits) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


def kl_divergence(theirs, ours) -> np.ndarray:
    """KL(theirs || ours) at each position (T,), of next-token probabilities (T, V)."""
    return np.sum(theirs * (np.log(np.maximum(theirs, 1e-30)) - np.log(np.maximum(ours, 1e-30))), axis=1)


def assert_agrees_with_llama_cpp(llm, path, ids, tmp_path, what):
    """llama.cpp's next-token probabilities on the file at `path` against npqwen's: top-1 equal on >= 95% of
    positions, mean KL(llama.cpp || npqwen) < 1e-3."""
    assert_agrees(llama_cpp_probs(path, ids, tmp_path), softmax(llm.forward(ids)), what)


def assert_agrees(theirs, ours, what):
    """Next-token probabilities (T, V) of llama.cpp (theirs) and npqwen (ours): top-1 equal on >= 95% of
    positions, mean KL(llama.cpp || npqwen) < 1e-3."""
    top1 = (ours.argmax(axis=1) == theirs.argmax(axis=1)).mean()
    kl = kl_divergence(theirs, ours)                                            # KL(llama.cpp || npqwen)
    print(f"{what} vs llama.cpp over {len(ours)} positions: top-1 equal {top1:.3f}, KL mean {kl.mean():.2e} "
          f"max {kl.max():.2e}")
    first = np.argmax(ours.argmax(axis=1) != theirs.argmax(axis=1))
    assert top1 >= 0.95, f"{what}: top-1 equal on {top1:.1%} of positions; the first differs at {first}"
    assert kl.mean() < 1e-3, f"{what}: KL(llama.cpp || npqwen) {kl.mean():.2e} (max {kl.max():.2e} at {kl.argmax()})"


# llama.cpp multiplies a Q8_0 matrix by activations it rounds to Q8_0 blocks too (npqwen keeps them float32). On this
# random model, whose next-token distribution is nearly flat (top probability ~2e-4), that can swap two near-tied
# top tokens: on a longer text (53 positions) 5 of 53 swapped (KL 1.6e-4); on this one none do.
@pytest.mark.parametrize("ftype", ["F32", "Q8_0"])
def test_agrees_with_llama_cpp(files, loaded, ftype, tmp_path):
    llm = loaded(ftype)
    assert_agrees_with_llama_cpp(llm, files[ftype], llm.tokenizer.encode(TEXT), tmp_path, ftype)


# Qwen2.5 (llama.cpp's qwen2): Qwen3's shape without QK-norm and with q/k/v biases (HF's Qwen2Config has no head_dim)
QWEN2 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
             vocab_size=151936, eos_token_id=151645, bos_token_id=151643, max_position_embeddings=2048,
             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen2_files(tmp_path_factory):
    """A random HF Qwen2 (transformers' Qwen2ForCausalLM, the real tokenizer) and llama.cpp's F32 and Q8_0 GGUF files
    of it (made once)."""
    needs_llama_cpp()
    needs_qwen3_tokenizer()
    pytest.importorskip("transformers")
    from test_qwen2 import build_qwen2

    def make(work):
        add_qwen3_tokenizer(build_qwen2(work / "hf", std=0.05, **QWEN2))
        convert_hf_to_gguf(work / "hf", work / "qwen2-F32.gguf")
        llama_quantize(work / "qwen2-F32.gguf", work / "qwen2-Q8_0.gguf", "Q8_0")

    root = made_once({"qwen2": QWEN2}, make, tmp_path_factory.mktemp("qwen2"))
    return {"hf": root / "hf", "F32": root / "qwen2-F32.gguf", "Q8_0": root / "qwen2-Q8_0.gguf"}


def test_qwen2_5_from_llama_cpp(qwen2_files, tmp_path):
    """Qwen2 / Qwen2.5 (llama.cpp's qwen2): blk.N.attn_q.bias ... are HF's q_proj.bias ..., the head width comes from
    the hidden size and heads (no key_length), no QK-norm. The Q8_0 file computes what npqwen's float32 does on the
    weights gguf dequantizes and names (its own tensor map), and llama.cpp agrees on it."""
    q8, ref = npqwen.load(qwen2_files["Q8_0"]), npqwen.load(qwen2_files["hf"])
    assert q8.config == ref.config and q8.config.attention_bias and not q8.config.qk_norm
    ids = ref.tokenizer.encode(TEXT)
    assert q8.tokenizer.encode(TEXT) == ids
    assert q8.weights["model.layers.0.self_attn.q_proj.weight"].format == "Q8_0"
    np.testing.assert_array_equal(q8.weights["model.layers.0.self_attn.k_proj.bias"],
                                  ref.weights["model.layers.0.self_attn.k_proj.bias"])   # F32 in the file
    assert_close(q8.forward(ids), dequantized_reference(qwen2_files["Q8_0"]).forward(ids), 1e-5, "qwen2 Q8_0 logits")
    assert_agrees_with_llama_cpp(q8, qwen2_files["Q8_0"], ids, tmp_path, "qwen2 Q8_0")


# Qwen3.5 as its real checkpoints are (Qwen3.5-9B: 16 key heads, 32 value heads): more value heads than key heads,
# which llama.cpp's converter reorders (npqwen/gguf_file.py's value_head_order); key and value heads of one width,
# as llama.cpp's qwen35 requires
QWEN35 = dict(vocab_size=151936, eos_token_id=151645, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16)


def hybrid_files(tmp_path_factory, config, name: str, **weights) -> dict:
    """An HF hybrid checkpoint of `config` (the real tokenizer; `weights`: build_hybrid_checkpoint's std and stds)
    and llama.cpp's F32 and Q8_0 GGUF files of it (made once): {"hf": its folder, "F32": ..., "Q8_0": ...}."""
    from hybrid_checkpoints import build_hybrid_checkpoint

    needs_llama_cpp()
    needs_qwen3_tokenizer()

    def make(work):
        add_qwen3_tokenizer(build_hybrid_checkpoint(work / "hf", config, save_dtype="float32", **weights))
        convert_hf_to_gguf(work / "hf", work / f"{name}-F32.gguf", "f32", "--no-mtp")
        llama_quantize(work / f"{name}-F32.gguf", work / f"{name}-Q8_0.gguf", "Q8_0")

    root = made_once([config, weights] if weights else config, make, tmp_path_factory.mktemp(name))
    return {"hf": root / "hf", "F32": root / f"{name}-F32.gguf", "Q8_0": root / f"{name}-Q8_0.gguf"}


@pytest.fixture(scope="module")
def qwen35_files(tmp_path_factory):
    """An HF Qwen3.5 (Hv = 2 Hk) and llama.cpp's GGUF files of it: F32 and Q8_0."""
    from hybrid_checkpoints import hybrid_config

    return hybrid_files(tmp_path_factory, hybrid_config(**QWEN35), "q35")


def hf_on_dequantized_weights(hf_dir, gguf_path, model=None):
    """HF transformers' Qwen3.5 (or Qwen3.5-MoE) in float32 holding the GGUF's tensors as gguf.quants.dequantize
    widens them, put back as HF holds them by the test's own hand: named by gguf-py's tensor map, the norms'
    1 + weight and A = -exp(A_log) undone, the value heads taken back from llama.cpp's tiled order, (r, Hk, d) ->
    (Hk, r, d) along their axis (the inverse of its converter's _reorder_v_heads), and a MoE layer's stacked gate
    and up experts joined as transformers holds them, (E, 2I, D). `model`: HF's model of hf_dir, already loaded."""
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from gguf.quants import dequantize
    from hybrid_checkpoints import hf_hybrid_model

    from npqwen.gguf_file import open_gguf

    model = model or hf_hybrid_model(hf_dir)
    c = model.config
    Hk, Hv, dv, qk = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim,
                      2 * c.linear_num_key_heads * c.linear_key_head_dim)
    reader = open_gguf(gguf_path)   # gguf's GGUFReader (through an ndarray view: faster)
    arch = reader.fields["general.architecture"].contents()
    names = get_tensor_name_map(next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch), c.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}

    def widened(gguf_name, shape):
        t = by_name[gguf_name]
        return torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(shape)

    def untile(x, dim, d):   # llama.cpp's tiled value heads (r, Hk, d) along `dim` -> HF's grouped (Hk, r, d)
        shape = x.shape
        x = x.reshape(*shape[:dim], Hv // Hk, Hk, d, *shape[dim + 1:])
        return x.transpose(dim, dim + 1).reshape(shape)

    state = {}
    for name, p in model.state_dict().items():
        base, _, suffix = name.rpartition(".")
        if name == "lm_head.weight" and "output.weight" not in by_name:
            base = "model.embed_tokens"   # tied
        if suffix == "gate_up_proj":   # (E, 2I, D): each expert's gate rows, then its up rows
            E, I2, D = p.shape
            state[name] = torch.cat([widened(f"{names.get_name(f'{base}.{part}')}.weight", (E, I2 // 2, D))
                                     for part in ("gate_proj", "up_proj")], dim=1)
            continue
        if suffix == "down_proj":      # (E, D, I)
            state[name] = widened(f"{names.get_name(name)}.weight", p.shape)
            continue
        gguf_name = {"A_log": names.get_name(f"{base}.A_log"), "dt_bias": f"{names.get_name(f'{base}.dt_proj')}.bias"
                     }.get(suffix, f"{names.get_name(base)}.{suffix}")
        x = widened(gguf_name, p.shape)   # conv1d: (C, W) -> (C, 1, W); the shared expert's gate: (D,) -> (1, D)
        if suffix == "A_log":
            x = torch.log(-x)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x - 1
        part = base.rpartition(".")[2]
        if part in ("in_proj_qkv", "conv1d"):
            x = torch.cat([x[:qk], untile(x[qk:], 0, dv)])
        elif part == "in_proj_z":
            x = untile(x, 0, dv)
        elif part in ("in_proj_a", "in_proj_b") or suffix in ("A_log", "dt_bias"):
            x = untile(x, 0, 1)
        elif part == "out_proj" and ".linear_attn." in name:
            x = untile(x, 1, dv)
        state[name] = x
    model.load_state_dict(state)
    return model


def test_qwen3_5_with_more_value_heads_from_llama_cpp(qwen35_files, tmp_path):
    """Qwen3.5 (llama.cpp's qwen35): its Gated DeltaNet tensors (attn_qkv, attn_gate, ssm_*) map to HF's linear_attn,
    the norms stored as 1 + weight and A as -exp(A_log) are undone, the convolution reshaped, and the value heads
    llama.cpp tiled put back in HF's order. The F32 file computes what the HF checkpoint does, to the bit; the Q8_0
    file what HF transformers computes on its weights widened by gguf (tests/tolerance.py's bound); llama.cpp's
    probabilities on the F32 file agree."""
    import torch

    from npqwen.gguf_file import ReorderedHeads
    from tolerance import model_tolerance, relative_diff

    gguf, ref = npqwen.load(qwen35_files["F32"]), npqwen.load(qwen35_files["hf"])
    assert gguf.config == ref.config and gguf.config.hybrid
    assert gguf.config.linear_num_value_heads == 2 * gguf.config.linear_num_key_heads
    ids = ref.tokenizer.encode(TEXT)
    np.testing.assert_array_equal(gguf.forward(ids), ref.forward(ids))
    assert gguf.generate(ids, 8).token_ids == ref.generate(ids, 8).token_ids

    q8 = npqwen.load(qwen35_files["Q8_0"])
    out_proj = q8.weights["model.layers.0.linear_attn.out_proj.weight"]
    assert isinstance(out_proj, ReorderedHeads) and out_proj.format == "Q8_0"   # kept as stored, columns gathered
    hf = hf_on_dequantized_weights(qwen35_files["hf"], qwen35_files["Q8_0"])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    got, bound = q8.forward(ids), model_tolerance(q8.config, len(ids))
    print(f"qwen35 Q8_0 against HF on the dequantized weights: relative {relative_diff(got, want):.3g} (bound {bound:.3g})")
    assert relative_diff(got, want) <= bound, f"qwen35 Q8_0 logits: relative {relative_diff(got, want):.3g} > {bound:.3g}"
    np.testing.assert_array_equal(np.asarray(out_proj.dequantize()), hf.state_dict()[
        "model.layers.0.linear_attn.out_proj.weight"].numpy())

    assert_agrees_with_llama_cpp(gguf, qwen35_files["F32"], ids, tmp_path, "qwen35 F32")


def test_lora_gradients_through_a_qwen35_gguf_with_reordered_value_heads(qwen35_files):
    """A LoRA adapter on the Q8_0 file's frozen matrices (its linear attention's in_proj_* and out_proj kept as
    stored, value heads in llama.cpp's order: ReorderedHeads): the adapter's gradients, which flow back through
    every frozen matrix by d_x = d_y @ W, equal those on the same weights dequantized into float32, within 1e-5."""
    from npqwen import finetune as ft
    from npqwen import grad
    from npqwen.gguf_file import ReorderedHeads
    from npqwen.lora import LINEAR_ATTENTION
    from test_weights import dequantized_twin

    q8 = npqwen.load(qwen35_files["Q8_0"])
    assert isinstance(q8.weights["model.layers.0.linear_attn.in_proj_qkv.weight"], ReorderedHeads)
    ex, got = ft.example([5, 17, 33, 2, 900], [101, 7, 64, 250, 11]), []
    for model in (q8.model, dequantized_twin(q8)):
        adapter = ft.new_adapter(model, r=2, alpha=4, targets=ft.TARGETS + LINEAR_ATTENTION, seed=0)
        rng = np.random.default_rng(1)
        for a in adapter.weights.values():   # B non-zero: every path has a gradient
            a[...] = 0.1 * rng.standard_normal(a.shape)
        got.append(grad.gradients(model, ex.ids, grad.loss(ex.targets), weights=False, lora=adapter).lora_grads)
    ours, want = got
    worst = max((float(np.abs(ours[n] - want[n]).max() / np.abs(want[n]).max()), n) for n in want)
    print(f"qwen35 Q8_0 GGUF: {len(want)} adapter gradients against the float32 twin's, worst relative {worst}")
    assert set(ours) == set(want) and worst[0] < 1e-5, worst


# Qwen3.5-MoE (llama.cpp's qwen35moe): Qwen3.5's layers (Hv = 2 Hk) with every MLP sparse, 8 experts of 32, 2 per
# token, and a shared expert of 64; every matrix's rows a whole number of Q8_0 blocks
QWEN35_MOE = dict(QWEN35, moe_intermediate_size=32, shared_expert_intermediate_size=64)
# its weights decided by margins, as a trained model's are: the router's rows of a larger spread (std 1: a token's
# k-th and next experts 0.56 apart in logit, the median of the smallest over its layers, not 0.04), the (tied)
# embedding too (0.2: the top token 0.35 probable, the median, not 4e-5 of 151,936), the other matrices at HF's
# initializer_range (0.02). With every matrix at 0.05, llama.cpp's Q8_0 product, which rounds the activations to
# Q8_0 blocks too, agreed on 23 of 30 top tokens (KL 8.2e-4), with npqwen and with llama.cpp's own F32 on the same
# widened weights alike (docs/gguf.md); here rounding them so in npqwen changes none of the 120 expert choices
QWEN35_MOE_WEIGHTS = dict(std=0.02, stds={"mlp.gate.weight": 1.0, "embed_tokens.weight": 0.2})


@pytest.fixture(scope="module")
def qwen35_moe_files(tmp_path_factory):
    """An HF Qwen3.5-MoE and llama.cpp's F32 and Q8_0 GGUF files of it."""
    from hybrid_checkpoints import hybrid_moe_config

    return hybrid_files(tmp_path_factory, hybrid_moe_config(**QWEN35_MOE), "q35moe", **QWEN35_MOE_WEIGHTS)


def test_qwen3_5_moe_from_llama_cpp(qwen35_moe_files, tmp_path):
    """Qwen3.5-MoE (llama.cpp's qwen35moe): the config from its metadata (experts, shared expert, Gated DeltaNet),
    the stacked experts (ffn_*_exps) and the shared expert (ffn_*_shexp, its gate a (D,) vector) under HF's names.
    The F32 file computes what the HF checkpoint does in npqwen, to the bit, and what HF transformers does in
    float32 (tests/tolerance.py's bound). The Q8_0 file keeps every expert as stored and computes what npqwen's
    float32 does on its weights widened by gguf.quants.dequantize (1e-5); llama.cpp's probabilities on the Q8_0
    file agree with npqwen's (issue 37's target: top-1 on >= 95% of positions, KL < 1e-3; measured 30 of 30, KL
    7.6e-5), and so do llama.cpp's on the F32 file of those widened weights (its float32 product, as on an F32
    file: 30 of 30, KL 4.3e-5; llama.cpp's Q8_0 against its own F32 there: KL 3.3e-5)."""
    import torch
    from hybrid_checkpoints import hf_hybrid_model

    from npqwen.weights import Ggml
    from tolerance import model_tolerance, relative_diff

    gguf, ref = npqwen.load(qwen35_moe_files["F32"]), npqwen.load(qwen35_moe_files["hf"])
    assert gguf.config == ref.config and gguf.config.hybrid and gguf.config.num_experts == 8
    assert gguf.config.shared_expert_intermediate_size == 64 and gguf.config.moe_intermediate_size == 32
    ids = ref.tokenizer.encode(TEXT)
    got = gguf.forward(ids)
    np.testing.assert_array_equal(got, ref.forward(ids))
    hf = hf_hybrid_model(qwen35_moe_files["hf"])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    bound = model_tolerance(gguf.config, len(ids))
    print(f"qwen35moe F32 against HF transformers: relative {relative_diff(got, want):.3g} (bound {bound:.3g})")
    assert relative_diff(got, want) <= bound, f"qwen35moe F32 logits: relative {relative_diff(got, want):.3g}"

    q8 = npqwen.load(qwen35_moe_files["Q8_0"])
    for part in ("experts.5.down_proj", "experts.0.gate_proj", "shared_expert.up_proj"):
        w = q8.weights[f"model.layers.1.mlp.{part}.weight"]
        assert isinstance(w, Ggml) and w.format == "Q8_0", (part, w)
    hf_on_dequantized_weights(qwen35_moe_files["hf"], qwen35_moe_files["Q8_0"], hf).save_pretrained(tmp_path / "deq")
    dequantized = npqwen.load(tmp_path / "deq")   # npqwen's float32 on gguf's widening (no tokenizer needed)
    assert_close(q8.forward(ids), dequantized.forward(ids), 1e-5, "qwen35moe Q8_0 logits against float32 on the "
                 "dequantized weights")
    assert q8.generate(ids, 8).token_ids == dequantized.generate(ids, 8).token_ids

    # llama.cpp on the Q8_0 file, and on the F32 file of the same weights widened (its own float32 product)
    widened = write_widened_gguf(qwen35_moe_files["Q8_0"], qwen35_moe_files["F32"], tmp_path / "widened-F32.gguf")
    theirs = llama_cpp_probs(qwen35_moe_files["Q8_0"], ids, tmp_path)
    theirs_f32 = llama_cpp_probs(widened, ids, tmp_path)
    ours = softmax(q8.forward(ids))
    assert_agrees(theirs, ours, "qwen35moe Q8_0")
    assert_agrees(theirs_f32, ours, "qwen35moe Q8_0 (llama.cpp's F32 of its widened weights)")
    print(f"llama.cpp's Q8_0 against its own F32 of the same weights: KL "
          f"{kl_divergence(theirs, theirs_f32).mean():.2e}")


def write_widened_gguf(quantized, f32, out):
    """llama.cpp's F32 file of a checkpoint (its converter's) with each tensor's data overwritten by the same
    tensor of `quantized` (llama.cpp's quantizer's file of it) widened by gguf.quants.dequantize: the quantized
    weights, metadata and all, for llama.cpp's float32 product."""
    from gguf.quants import dequantize

    from npqwen.gguf_file import open_gguf   # gguf's GGUFReader, faster through an ndarray view

    shutil.copyfile(f32, out)
    at = {t.name: (t.data_offset, t.n_bytes) for t in open_gguf(f32).tensors}   # where each tensor's bytes start
    file = np.memmap(out, mode="r+")
    for t in open_gguf(quantized).tensors:
        widened = dequantize(t.data, t.tensor_type).astype("<f4").reshape(-1).view(np.uint8)
        start, size = at[t.name]
        assert widened.size == size, (t.name, widened.size, size)
        file[start:start + size] = widened
    file.flush()
    return out
