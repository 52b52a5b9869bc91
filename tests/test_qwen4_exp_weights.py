"""Qwen4-Exp on compact weights (npqwen/weights.py): every matrix (attention, the QSA indexer, Gated DeltaNet, the
experts, the shared expert, PLE's projections, the hyper-connections' mixing and injection projections, the embedding,
lm_head) kept in each format, the PLE tables left on disk as stored, the small vectors float32. For each format npqwen's logits equal
npqwen's float32 logits on the weights dequantized by the format's own rule (1e-5 relative), prefill, decode and
the engine; a bfloat16 checkpoint read as stored equals HF transformers on it; `npqwen quantize` writes one. Then
llama.cpp's own GGUF files of a tiny Qwen4-Exp (arch qwen4exp): F32 equals transformers, Q8_0 equals npqwen float32
on the weights gguf.quants.dequantize widens, and llama.cpp's probabilities on the Q8_0 file agree (skipped, saying
why, without llama.cpp, node or Qwen3's tokenizer files)."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine
from npqwen.checkpoint import is_matrix
from npqwen.ple import NgramTable
from npqwen.weights import is_compact

torch = pytest.importorskip("torch")
qwen4 = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

from test_qwen4_exp import MODEL, golden  # noqa: E402
from test_weights import assert_close, dequantized_twin  # noqa: E402

# every matrix's rows are whole Q4_K super-blocks (256 values; the hyper-connections mix at rank 256): no format falls
# back; rotary 16 of 128 (it must fit the indexer's heads of 16); a Gated DeltaNet layer with PLE (llama.cpp's qwen4exp
# reads one PLE layer), twice as many value heads as key heads (which llama.cpp's converter reorders) and a sigmoid
# output gate (transformers' other choice, the one llama.cpp's qwen4exp computes), then a QSA layer
BLOCKY = dict(MODEL, num_hidden_layers=2, full_attention_interval=2, hidden_size=256, num_attention_heads=2,
              num_key_value_heads=1, head_dim=128, hc_lowrank=256,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
              moe_intermediate_size=256, shared_expert_intermediate_size=256, ple_embed_dim=256, ple_layer_ids=[1],
              output_gate_type="sigmoid", rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.125})
FORMATS = ["stored", "float16", "int8", "q8_0", "q4_0", "q4_k"]   # ("bfloat16" of a bfloat16 file is "stored")


def build_blocky(path, save_dtype="bfloat16", text=None):
    """A random Qwen4ExpForCausalLM saved by transformers, its matrices drawn at std 0.05 (at 0.3 the model is so
    chaotic that float32 rounding alone moves its logits by 1e-5); HF's float32 model of the same files."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    torch.manual_seed(0)
    model = qwen4.Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**BLOCKY, **(text or {})}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            small = name.endswith("norm.weight") or "A_log" in name or "ngram_embedding" in name
            p.normal_(0.0, 0.3 if small else 0.05)
    model.to(getattr(torch, save_dtype)).save_pretrained(path)
    return path, qwen4.Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def blocky(tmp_path_factory):
    return build_blocky(tmp_path_factory.mktemp("qwen4_blocky"))


def prompt(n=40, seed=0):
    ids = np.random.default_rng(seed).integers(0, BLOCKY["vocab_size"], n)
    ids[7] = ids[8] = BLOCKY["eos_token_id"]   # n-grams never reach back past an end of text
    return ids


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_equals_float32_on_its_dequantized_weights(fmt, blocky):
    llm = npqwen.load(blocky[0], weights=fmt)
    kept = {n: w.format.lower() for n, w in llm.weights.items() if is_compact(w)}
    matrices = {n for n in llm.weights if is_matrix(n)}
    assert set(kept) == matrices and set(kept.values()) == {"bfloat16" if fmt == "stored" else fmt}, kept
    floats = {n for n, w in llm.weights.items() if isinstance(w, np.ndarray) and w.ndim == 2}
    assert all(n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) for n in floats), floats   # (the routers)
    mixes = {n for n in llm.weights if "hyper_connection" in n and not n.endswith("hc_norm.weight")}
    assert len(mixes) == 2 * 3 * 2 + 2 and mixes <= set(kept), mixes - set(kept)   # 2 layers x 2 blocks x 3, mixer 2
    table = llm.weights["model.layers.0.ple.ple_embedding.ngram_embedding.weight"]
    assert isinstance(table, NgramTable) and all(isinstance(p.base, np.memmap) for p in table.parts)
    assert isinstance(llm.model.fused["model.layers.1.mlp.experts.gate_up_proj"], list)   # the experts, compact
    twin = dequantized_twin(llm)
    ids = prompt()
    assert_close(llm.forward(ids), twin.forward(ids), 1e-5, f"Qwen4-Exp {fmt} prefill")
    cache, twin_cache = llm.new_cache(64), twin.new_cache(64)   # decode: up to 128 rows take the other product
    llm.forward(ids[:30], cache), twin.forward(ids[:30], twin_cache)
    assert_close(llm.forward(ids[30:31], cache), twin.forward(ids[30:31], twin_cache), 1e-5, f"Qwen4-Exp {fmt} decode")


def test_bfloat16_as_stored_equals_transformers(blocky):
    """The bfloat16 file read as stored (memory-mapped, widened a block of rows at a time) against HF's float32 model
    of the same bfloat16 weights (with its sigmoid output gate): tests/tolerance.py's bound, HF's argmax."""
    llm = npqwen.load(blocky[0], weights="stored")
    w = llm.weights["model.layers.1.self_attn.indexer.index_qk_proj.weight"]
    assert w.format == "bfloat16" and isinstance(w.storage.base, np.memmap)
    golden(llm, blocky[1], prompt(48, seed=1).tolist(), "Qwen4-Exp bfloat16 as stored vs transformers")


def test_the_engine_on_q4_k(blocky):
    """Batched with chunked prefill (three prompts, 32 tokens a step) equals each prompt alone on the dequantized
    twin: the same greedy tokens, logits within 1e-5 relative."""
    from test_engine import alone, compare, prompts, run

    llm = npqwen.load(blocky[0], weights="q4_k")
    twin = npqwen.LLM(dequantized_twin(llm), llm.tokenizer, llm.generation_defaults)
    ps = prompts([3, 40, 70], seed=3, vocab=BLOCKY["vocab_size"])
    engine = Engine(llm, kv_cache_tokens=16 * 16, page_size=16, max_batched_tokens=32)
    for p, (tokens, logits, _) in zip(ps, run(engine, [(p, dict(max_new_tokens=4, temperature=0)) for p in ps],
                                          spy=True)):
        assert compare(f"q4_k engine: prompt {len(p)}", tokens, logits, *alone(twin, p, 4)) <= 1e-5


def test_quantize_writes_a_qwen4_exp_checkpoint(blocky, tmp_path):
    """`npqwen quantize --to q8_0`: the matrices as ggml blocks, the PLE table's shards copied as stored; read back
    as stored it computes what loading with weights='q8_0' computes."""
    from npqwen.checkpoint import index_checkpoint
    from npqwen.cli import main

    assert main(["quantize", str(blocky[0]), str(tmp_path / "q8"), "--to", "q8_0"]) == 0
    stored = index_checkpoint(tmp_path / "q8")
    assert stored["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"].dtype == "BF16"
    assert stored["model.layers.1.self_attn.indexer.index_qk_proj.weight"].qtype == "Q8_0"
    llm, want = npqwen.load(tmp_path / "q8"), npqwen.load(blocky[0], weights="q8_0")
    ids = prompt(20)
    np.testing.assert_array_equal(llm.forward(ids), want.forward(ids))
    from npqwen.describe import describe, format_bytes
    text = describe(str(tmp_path / "q8"))   # inspect: the bytes of each format, the tables on disk as stored
    sizes = format_bytes(llm.config)
    print(text[text.index("weights in memory"):])
    assert "the PLE tables stay on disk as stored" in text and "Q8_0" in text
    assert sizes["q4_k"] < sizes["q8_0"] < sizes["bfloat16"] < sizes["float32"]


# -- llama.cpp's GGUF of Qwen4-Exp (its converter's qwen4exp, node-llama-cpp 3.21.1) --

# Qwen3's tokenizer (llama.cpp's converter needs one), a sigmoid Gated DeltaNet output gate (llama.cpp's qwen4exp
# computes no other; transformers' default is SiLU), one PLE layer (llama.cpp reads one), and a QSA budget above the
# prompts' length: llama.cpp's converter writes compress_ratios 0 for transformers' "indexed_attention" layers, and
# llama.cpp (npqwen after it) then attends to every token, which is what QSA keeps while a prompt fits its budget;
# the hyper-connections mix at rank 8, so llama.cpp's quantizer keeps their up matrices (8 columns) F16, the rest Q8_0
GGUF_SHAPE = dict(BLOCKY, hc_lowrank=8, vocab_size=151936, eos_token_id=151645, hidden_size=64, head_dim=32,
                  linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, ple_embed_dim=64, indexer_budget=64,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
TEXT = "The quick brown fox jumps over the lazy dog. 日本語も少し。 def f(x):\n    return x ** 2"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """The HF checkpoint (float32) and llama.cpp's F32 and Q8_0 GGUF files of it (made once, kept in .cache)."""
    import json

    from conftest import add_qwen3_tokenizer, needs_qwen3_tokenizer
    from gguf_helpers import convert_hf_to_gguf, llama_quantize, made_once, needs_llama_cpp

    pytest.importorskip("gguf")
    needs_llama_cpp()
    needs_qwen3_tokenizer()

    def make(work):
        hf = add_qwen3_tokenizer(build_blocky(work / "hf", "float32", GGUF_SHAPE)[0])
        config = json.loads((hf / "config.json").read_text())   # as the hub's config.json says it (transformers
        config["full_attention_interval"] = 2                     # does not save it; the converter's default is 4)
        (hf / "config.json").write_text(json.dumps(config, indent=2))
        convert_hf_to_gguf(hf, work / "F32.gguf")
        llama_quantize(work / "F32.gguf", work / "Q8_0.gguf", "Q8_0")

    root = made_once({"qwen4exp": GGUF_SHAPE}, make, tmp_path_factory.mktemp("qwen4exp_gguf"))
    return {"hf": root / "hf", "F32": root / "F32.gguf", "Q8_0": root / "Q8_0.gguf"}


@pytest.fixture(scope="module")
def loaded(gguf_files):
    """Each file loaded once (a GGUF with Qwen3's 151,936-token vocabulary takes seconds to read)."""
    cache = {}

    def get(name):
        if name not in cache:
            if name == "hf":
                cache[name] = npqwen.load(gguf_files[name])
            else:
                with pytest.warns(UserWarning, match="compress_ratios is 0"):   # read as llama.cpp reads it, said so
                    cache[name] = npqwen.load(gguf_files[name])
        return cache[name]
    return get


def test_gguf_f32_equals_transformers(gguf_files, loaded):
    """F32: the config from the GGUF's metadata, the tokenizer from its lists, llama.cpp's names mapped back to HF's
    (every weight equal to the checkpoint's, to the rounding of the norms' 1 + w), the same trace step names, and
    transformers' float32 logits (tests/tolerance.py's bound) and argmax."""
    from npqwen.hooks import step_names

    gguf, ref = loaded("F32"), loaded("hf")
    for key in ("hidden_size", "num_hidden_layers", "layer_types", "hc_count", "hc_lowrank", "ple_layer_ids",
                "ple_embed_dim", "ngram_size", "heads_per_ngram", "indexer_n_heads", "indexer_head_dim", "num_experts",
                "shared_expert_intermediate_size", "linear_num_value_heads", "rotary_dim", "output_gate_type"):
        assert getattr(gguf.config, key) == getattr(ref.config, key), key
    for name, w in ref.weights.items():
        if name.endswith("ngram_embedding.weight"):
            rows = np.arange(w.shape[0])
            np.testing.assert_array_equal(gguf.weights[name][rows], w[rows], err_msg=name)
        else:
            np.testing.assert_allclose(np.asarray(gguf.weights[name]), w, rtol=0, atol=1e-6, err_msg=name)
    ids = ref.tokenizer.encode(TEXT)
    assert gguf.tokenizer.encode(TEXT) == ids and gguf.tokenizer.chat_template == ref.tokenizer.chat_template
    assert step_names(gguf.config) == step_names(ref.config)
    hf = qwen4.Qwen4ExpForCausalLM.from_pretrained(gguf_files["hf"], dtype=torch.float32).eval()
    golden(gguf, hf, ids, "qwen4exp F32 GGUF vs transformers")


def test_gguf_q8_0_equals_float32_on_the_gguf_package_dequantized_weights(gguf_files, loaded):
    """Q8_0 (with llama.cpp's F16 and F32 fallbacks; its PLE table Q8_0 too): every matrix kept as the file stores
    it (the hyper-connections' down and injection matrices Q8_0, their up matrices F16, over the file's mapped bytes)
    widens as gguf.quants.dequantize widens those bytes; the model on them equals npqwen float32 on them (1e-5)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from npqwen.gguf_file import ReorderedHeads, TableRows, hf_name, open_gguf

    llm = loaded("Q8_0")
    table = llm.weights["model.layers.0.ple.ple_embedding.ngram_embedding.weight"].parts[0]
    stored = {**{n: w for n, w in llm.weights.items() if is_compact(w)}, "PLE table": table.w}
    assert isinstance(table, TableRows) and {w.format for w in stored.values()} >= {"Q8_0", "float16"}
    mixes = {n: stored[n].format for n in llm.weights if "hyper_connection" in n and not n.endswith("hc_norm.weight")}
    assert set(mixes.values()) == {"Q8_0", "float16"} and all(f == "float16" for n, f in mixes.items() if "_up." in n)
    in_file = {hf_name(t.name): t.data for t in open_gguf(gguf_files["Q8_0"]).tensors}   # gguf's GGUFReader's bytes
    for n in mixes:   # kept as stored: the file's bytes, bit for bit (Q8_0's planes interleaved back)
        np.testing.assert_array_equal(np.asarray(stored[n].storage).view(np.uint8).reshape(-1),
                                      np.asarray(in_file[n]).view(np.uint8).reshape(-1), err_msg=n)
    for name, w in stored.items():
        for part in getattr(w, "parts", [w]):   # (the indexer's q and k rows are F32 in llama.cpp's files)
            part = part.stored if isinstance(part, ReorderedHeads) else part
            if part.format in ("Q8_0", "float16"):
                qtype = GGMLQuantizationType.Q8_0 if part.format == "Q8_0" else GGMLQuantizationType.F16
                want = dequantize(np.asarray(part.storage).view(np.uint8), qtype)
                np.testing.assert_array_equal(part.dequantize(), want.reshape(part.shape), err_msg=name)
    ids = llm.tokenizer.encode(TEXT)
    assert_close(llm.forward(ids), dequantized_twin(llm).forward(ids), 1e-5, "qwen4exp Q8_0 GGUF")


def test_gguf_q8_0_agrees_with_llama_cpp(gguf_files, loaded, tmp_path):
    """llama.cpp's own next-token probabilities on the same Q8_0 file: top-1 equal on >= 95% of positions, KL < 1e-3
    (the F32 file agrees too: top-1 equal at every position, KL 4e-5 at most, measured when this was written)."""
    from test_gguf_llama_cpp import assert_agrees_with_llama_cpp

    llm = loaded("Q8_0")
    assert_agrees_with_llama_cpp(llm, gguf_files["Q8_0"], llm.tokenizer.encode(TEXT), tmp_path, "qwen4exp Q8_0")
