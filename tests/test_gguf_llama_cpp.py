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
@pytest.mark.parametrize("ftype", ["F32", "Q8_0"])
def test_agrees_with_llama_cpp(files, loaded, ftype, tmp_path):
    llm = loaded(ftype)
    ids = llm.tokenizer.encode(TEXT)
    theirs = llama_cpp_probs(files[ftype], ids, tmp_path)                       # (T, V)
    logits = np.asarray(llm.forward(ids), np.float64)
    ours = np.exp(logits - logits.max(axis=1, keepdims=True))
    ours /= ours.sum(axis=1, keepdims=True)
    top1 = (ours.argmax(axis=1) == theirs.argmax(axis=1)).mean()
    kl = np.sum(theirs * (np.log(np.maximum(theirs, 1e-30)) - np.log(ours)), axis=1)   # KL(llama.cpp || npqwen)
    print(f"{ftype} vs llama.cpp over {len(ids)} positions: top-1 equal {top1:.3f}, KL mean {kl.mean():.2e} "
          f"max {kl.max():.2e}")
    first = np.argmax(ours.argmax(axis=1) != theirs.argmax(axis=1))
    assert top1 >= 0.95, f"{ftype}: top-1 equal on {top1:.1%} of positions; the first differs at {first}"
    assert kl.mean() < 1e-3, f"{ftype}: KL(llama.cpp || npqwen) {kl.mean():.2e} (max {kl.max():.2e} at {kl.argmax()})"


def test_qwen3_5_from_llama_cpp(tmp_path):
    """Qwen3.5 (llama.cpp's qwen35): its Gated DeltaNet tensors (attn_qkv, attn_gate, ssm_*) map to HF's linear_attn,
    the norms stored as 1 + weight and A as -exp(A_log) are undone, the convolution reshaped; the F32 file computes
    what the HF checkpoint does."""
    from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_config

    needs_llama_cpp()
    needs_qwen3_tokenizer()
    config = hybrid_config(vocab_size=151936, eos_token_id=151645, linear_num_value_heads=2)   # Hv = Hk

    def make(work):
        add_qwen3_tokenizer(build_hybrid_checkpoint(work / "hf", config, save_dtype="float32"))
        convert_hf_to_gguf(work / "hf", work / "q35.gguf", "f32", "--no-mtp")

    root = made_once(config, make, tmp_path / "made")
    gguf, ref = npqwen.load(root / "q35.gguf"), npqwen.load(root / "hf")
    assert gguf.config == ref.config and gguf.config.hybrid
    ids = ref.tokenizer.encode(TEXT)
    assert_close(gguf.forward(ids), ref.forward(ids), 1e-5, "qwen35 F32 logits")
    assert gguf.generate(ids, 8).token_ids == ref.generate(ids, 8).token_ids
