"""Compact weights (npqwen/weights.py): for each format, npqwen's logits equal npqwen's float32 logits on the
weights dequantized by the format's own rule (the gguf package's for ggml blocks, the FP8 checkpoint's block
scales); bfloat16 checkpoints equal HF transformers loaded in bfloat16 and upcast; every consumer (the engine,
MoE, Gated DeltaNet, LoRA, hooks, lens, embeddings, tensor parallelism) runs on them."""
import json

import numpy as np
import pytest

import npqwen
from npqwen import quants
from npqwen.checkpoint import allocate_weights, index_checkpoint, tie_lm_head
from npqwen.errors import NpqwenError
from npqwen.model import Qwen3
from npqwen.weights import Ggml, Rows, as_array, is_compact

from conftest import QWEN3_0_6B, build_hf_checkpoint, hf_model, tiny_config, write_npqwen_checkpoint

# every matrix of these takes whole Q4_K super-blocks (256 values a row): no format falls back
BLOCKY = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64, num_hidden_layers=2)
CONVERTED = ["bfloat16", "float16", "int8", "q8_0", "q4_0", "q4_k"]
# Qwen3-0.6B's width (D, F, heads) in 1 layer and a small vocabulary
QWEN3_0_6B_WIDTH = {**QWEN3_0_6B, "num_hidden_layers": 1, "max_window_layers": 1, "vocab_size": 4096,
                    "bos_token_id": 4094, "eos_token_id": 4095}


def dequantized_twin(llm) -> Qwen3:
    """The same model with every weight dequantized by its format's rule, run in plain float32 (Qwen4-Exp: by its
    own class, its PLE tables the same mapped tables, which no format converts)."""
    model, config = llm.model, llm.config
    tables = {n: w for n, w in model.weights.items() if n.endswith("ngram_embedding.weight")}
    arrays, fused = allocate_weights(config, np, np.float32, {n: tuple(w.shape) for n, w in model.weights.items()
                                                              if n not in tables and (n != "lm_head.weight" or
                                                                                      not config.tie_word_embeddings)})
    for name, array in arrays.items():
        array[...] = as_array(model.weights[name])
    return type(model)(config, {**tie_lm_head(config, arrays), **tables}, fused)


def assert_close(got, want, rtol: float, what: str):
    diff = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    print(f"{what}: max |diff| {diff:.3g}, max |logit| {scale:.3g}")
    assert diff <= rtol * scale, f"{what}: max |diff| {diff:.3g} > {rtol} x {scale:.3g}"


@pytest.fixture(scope="module")
def blocky_dir(tmp_path_factory):
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("blocky"), BLOCKY, dtype="BF16")


@pytest.mark.parametrize("fmt", CONVERTED)
def test_each_format_equals_float32_on_its_dequantized_weights(fmt, blocky_dir):
    llm = npqwen.load(blocky_dir, weights=fmt)
    q = llm.weights["model.layers.0.self_attn.q_proj.weight"]
    assert is_compact(q) and q.format.lower() == fmt and q.shape == (256, 256)
    assert isinstance(llm.model.fused["model.layers.0.self_attn.qkv_proj.weight"], Rows)
    ids = np.random.default_rng(0).integers(0, 512, 40)
    twin = dequantized_twin(llm)
    assert_close(llm.forward(ids), twin.forward(ids), 1e-5, f"{fmt} prefill")
    cache, twin_cache = llm.new_cache(64), twin.new_cache(64)     # decode: up to 128 rows take the other product
    llm.forward(ids[:30], cache), twin.forward(ids[:30], twin_cache)
    assert_close(llm.forward(ids[30:31], cache), twin.forward(ids[30:31], twin_cache), 1e-5, f"{fmt} decode")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K"])
def test_ggml_rows_dequantize_as_the_gguf_package_does(qtype):
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(1).standard_normal((48, 512)).astype(np.float32)
    weight = Ggml.quantize(qtype, w)
    blocks = quants.quantize_rows(qtype, w)
    np.testing.assert_array_equal(weight.storage, blocks)   # Q8_0, Q4_0: split into planes and joined back, bit for bit
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(weight.dequantize(), want)
    np.testing.assert_array_equal(weight.take(np.array([5, 0, 47])), want[[5, 0, 47]])
    np.testing.assert_array_equal(weight.columns(slice(256, 512)).dequantize(), want[:, 256:])
    x = np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_allclose(weight.linear(x), x @ want.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-qwen3.5"])
@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_moe_experts_and_gated_deltanet_layers_run_compact(name, fmt):
    llm = npqwen.load(name, weights=fmt)
    ids = list(range(20, 60))
    assert_close(llm.forward(ids), dequantized_twin(llm).forward(ids), 1e-5, f"{name} {fmt}")


def test_bfloat16_checkpoint_equals_transformers_in_bfloat16_upcast(tmp_path):
    torch = pytest.importorskip("torch")
    path = build_hf_checkpoint(tmp_path, tiny_config(), save_dtype="bfloat16")
    llm = npqwen.load(path, weights="stored")
    w = llm.weights["model.layers.1.mlp.down_proj.weight"]
    assert w.format == "bfloat16" and isinstance(w.storage.base, np.memmap) and not w.storage.flags.writeable
    hf = hf_model(path)   # the bfloat16 weights upcast to float32 as transformers loads them (not .to(bfloat16),
    # which would round RoPE's inv_freq buffer too)
    assert all(torch.equal(p, p.bfloat16().float()) for p in hf.parameters())
    ids = np.random.default_rng(3).integers(0, 512, 17)
    with torch.no_grad():
        want = hf(torch.tensor(ids)[None]).logits[0].numpy()
    assert_close(llm.forward(ids), want, 1e-4, "bfloat16 vs transformers")
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor(ids)[None], max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert llm.generate(ids.tolist(), max_new_tokens=8, temperature=0).token_ids == hf_tokens


def write_fp8_checkpoint(path, source, block: int = 128):
    """Qwen's *-FP8 layout from a bf16 checkpoint: each linear layer's weight as float8 e4m3fn with
    weight_scale_inv (one float32 per 128x128 block, W = fp8 * scale_inv); embedding and norms as they were.
    Returns the dequantized weights by the same rule, in torch."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors, out, rule = load_file(source / "model.safetensors"), {}, {}
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            out[name] = t
            continue
        w = t.float()
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3))
        scale = (amax / 448.0).clamp(min=1e-12)                                          # (rows, cols)
        wide = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
        q = (w / wide).to(torch.float8_e4m3fn)
        out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q, scale
        rule[name] = q.float() * wide
    save_file(out, path / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [block, block]}
    (path / "config.json").write_text(json.dumps(config))
    return rule


def test_fp8_checkpoint_equals_its_block_scales_rule(tmp_path):
    pytest.importorskip("torch")
    source = build_hf_checkpoint(tmp_path / "bf16", tiny_config(hidden_size=256, intermediate_size=320))
    (tmp_path / "fp8").mkdir()
    rule = write_fp8_checkpoint(tmp_path / "fp8", source)   # 320 columns: a last block of 64
    llm = npqwen.load(tmp_path / "fp8")                      # auto: a quantized file stays as stored
    down = llm.weights["model.layers.0.mlp.down_proj.weight"]
    assert down.format == "fp8" and down.storage.dtype == np.uint8
    for name, want in rule.items():
        np.testing.assert_array_equal(as_array(llm.weights[name]), want.numpy(), err_msg=name)
    ids = np.random.default_rng(4).integers(0, 512, 30)
    assert_close(llm.forward(ids), dequantized_twin(llm).forward(ids), 1e-5, "fp8")
    widened = npqwen.load(tmp_path / "fp8", weights="float32")   # or widened whole, once, on request
    assert not is_compact(widened.weights["model.layers.0.mlp.down_proj.weight"])
    assert_close(widened.forward(ids), llm.forward(ids), 1e-5, "fp8 as float32")


def test_an_fp8_checkpoint_without_its_scales_is_one_clear_error(tmp_path, capsys):
    pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    source = build_hf_checkpoint(tmp_path / "bf16", tiny_config())
    (tmp_path / "fp8").mkdir()
    write_fp8_checkpoint(tmp_path / "fp8", source)
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "fp8" / "model.safetensors")
    with pytest.raises(NpqwenError, match="o_proj.weight_scale_inv"):
        npqwen.load(tmp_path / "fp8")
    from npqwen.cli import main
    from test_cli import one_error_line

    capsys.readouterr()
    code = main(["quantize", str(tmp_path / "fp8"), str(tmp_path / "out"), "--to", "int8"])   # (no tokenizer needed)
    one_error_line(code, capsys.readouterr().err, "o_proj.weight_scale_inv")


def test_q4_k_on_an_embedding_model(capsys):
    """--weights q4_k on an embedding model: the matrices without whole 256-value super-blocks (tiny-embedding's
    64 and 96 columns) are kept in the nearest format that fits, as for any model, and the vectors come out; with a
    compute dtype compact weights cannot take (float64), one line says what to do."""
    from npqwen.cli import main
    from test_cli import one_error_line

    assert main(["embed", "--model", "tiny-embedding", "--weights", "q4_k", "--text", "hello"]) == 0
    assert "embeddings: 1 x" in capsys.readouterr().err
    code = main(["embed", "--model", "tiny-embedding", "--weights", "q4_k", "--dtype", "float64", "--text", "hello"])
    one_error_line(code, capsys.readouterr().err, "compact weights (q4_k) compute in float32")


def test_unknown_format_and_compact_in_float64_are_refused(npqwen_tiny_dir):
    with pytest.raises(NpqwenError, match="unknown weights format 'q3_k'"):
        npqwen.load(npqwen_tiny_dir, weights="q3_k")
    with pytest.raises(NpqwenError, match="compute in float32"):
        npqwen.load(npqwen_tiny_dir, dtype="float64", weights="int8")


def test_a_matrix_without_whole_blocks_falls_back_to_a_format_that_fits(npqwen_tiny_dir):
    llm = npqwen.load(npqwen_tiny_dir, weights="q4_k")     # 64 and 96 columns: no whole 256-value super-block
    assert {w.format for w in llm.weights.values() if is_compact(w)} == {"Q8_0"}


@pytest.fixture(scope="module")
def unblocky_dir(tmp_path_factory):   # q/k/v/o, gate/up: 64 columns, whole Q8_0 blocks only; down_proj: 48, none
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("unblocky"), tiny_config(intermediate_size=48), dtype="BF16")


def needed_bytes(path, fmt, have: int, monkeypatch) -> bool:
    """Whether loading `path` in `fmt` passes its memory check (check_fits_compact) with `have` bytes free."""
    from npqwen import checkpoint
    monkeypatch.setattr(checkpoint, "free_memory_bytes", lambda xp: have)
    try:
        npqwen.load(path, weights=fmt)
    except NpqwenError as e:
        assert "the weights need" in str(e), e
        return False
    return True


@pytest.mark.parametrize("fmt", CONVERTED)
def test_inspect_and_the_memory_check_count_the_bytes_the_loaded_weights_take(fmt, blocky_dir, unblocky_dir,
                                                                              monkeypatch):
    """`npqwen inspect`'s size of each format (describe.format_bytes) and the memory check before loading
    (check_fits_compact) count each matrix in the format it is kept in (weights.kept_format: a matrix without whole
    blocks of the format in Q8_0 where its rows are whole Q8_0 blocks, else bfloat16), its scales included (int8's
    per row, the ggml planes' per block): the bytes the loaded weights take (weights.total_bytes)."""
    from npqwen.describe import format_bytes
    from npqwen.weights import total_bytes

    for path in (blocky_dir, unblocky_dir):
        llm = npqwen.load(path, weights=fmt)
        if path == unblocky_dir and fmt in ("q8_0", "q4_0", "q4_k"):
            kept = {w.format for n, w in llm.weights.items() if is_compact(w) and "down_proj" in n}
            assert kept == {"bfloat16"}, kept
        loaded = total_bytes(llm.model.weights)
        print(f"{path.name} {fmt}: loaded {loaded:,} bytes, inspect says {format_bytes(llm.config)[fmt]:,}")
        assert format_bytes(llm.config)[fmt] == loaded
        assert needed_bytes(path, fmt, loaded, monkeypatch), f"{fmt}: refused with {loaded:,} bytes free"
        assert not needed_bytes(path, fmt, loaded - 1, monkeypatch), f"{fmt}: loaded with {loaded - 1:,} free"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-qwen3.5", "tiny-qwen4-exp"])
def test_inspect_s_size_of_each_format_is_what_the_built_in_models_take(name):
    """describe.format_bytes for float32 and each format equals weights.total_bytes of the built-in model loaded in
    it: MoE's experts, Gated DeltaNet's and the hyper-connections' projections, 16 columns kept in bfloat16 where no
    ggml block fits (Qwen4-Exp: but its PLE tables, which inspect lists apart, on disk in a checkpoint)."""
    from npqwen.describe import format_bytes
    from npqwen.weights import total_bytes

    sizes = format_bytes(npqwen.load(name).config)
    for fmt, size in sizes.items():
        weights = npqwen.load(name, weights=fmt).model.weights
        loaded = total_bytes({n: w for n, w in weights.items() if ".ple.ple_embedding." not in n})
        assert size == loaded, f"{name} {fmt}: inspect says {size:,} bytes, the loaded weights take {loaded:,}"


def engine_run(llm, prompts) -> tuple[list, dict]:
    """Greedy tokens of `prompts` from one engine over small pages (chunked prompts, a prefix hit, preemption)."""
    engine = npqwen.Engine(llm, kv_cache_tokens=96, page_size=8, max_batch_size=4, max_batched_tokens=24)
    ids = [engine.add_request(p, max_new_tokens=24, temperature=0) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.result.token_ids
        engine.check()
    return [done[i] for i in ids], engine.stats


def test_the_engine_batches_compact_weights_as_the_float32_twin(blocky_dir):
    llm = npqwen.load(blocky_dir, weights="q4_k")
    twin = npqwen.LLM(dequantized_twin(llm), llm.tokenizer, llm.generation_defaults)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17, 40)]
    got, stats = engine_run(llm, prompts)
    assert got == engine_run(twin, prompts)[0]
    print(stats)
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_lora_hooks_lens_and_embeddings_on_a_compact_base(tmp_path):
    llm = npqwen.load("tiny", weights="int8")
    twin = npqwen.LLM(dequantized_twin(llm), llm.tokenizer, llm.generation_defaults)
    ids = list(range(30, 50))
    cache = llm.run_with_cache(ids, names=["model.layers.1.mlp.down_proj"])[1]
    twin_cache = twin.run_with_cache(ids, names=["model.layers.1.mlp.down_proj"])[1]
    assert_close(cache["model.layers.1.mlp.down_proj"], twin_cache["model.layers.1.mlp.down_proj"], 1e-5, "hook")
    lens, twin_lens = llm.logit_lens(ids), twin.logit_lens(ids)
    assert (lens.top_ids == twin_lens.top_ids).all()
    attribution = llm.logit_attribution(ids, 65)
    assert np.allclose(attribution.heads, twin.logit_attribution(ids, 65).heads, rtol=1e-4, atol=1e-5)
    emb = npqwen.load("tiny-embedding", weights="int8")
    assert np.isfinite(emb.embed(["a cat", "a dog"])).all()


def test_a_lora_adapter_on_a_compact_base_adds_what_it_adds_to_the_float32_twin(tmp_path):
    pytest.importorskip("peft")
    from test_lora import ALL, write_adapter

    base = build_hf_checkpoint(tmp_path / "base", BLOCKY, std=0.02)
    adapter = write_adapter(base, tmp_path / "adapter", 0, r=8, lora_alpha=16, target_modules=ALL)
    llm = npqwen.load(base, weights="q8_0", lora={"a": adapter})
    twin = npqwen.LLM(dequantized_twin(llm), llm.tokenizer, llm.generation_defaults).load_lora("a", adapter)
    ids = list(range(7, 40))
    with_adapter = llm.forward(ids, lora="a")
    assert_close(with_adapter, twin.forward(ids, lora="a"), 1e-5, "q8_0 + LoRA")
    assert np.abs(with_adapter - llm.forward(ids)).max() > 1e-3   # the adapter did change the logits
    with pytest.raises(NpqwenError, match="merge"):
        from npqwen.lora import merge
        merge(llm.model.weights, llm.lora_adapter("a"))


def test_save_writes_compact_weights_dequantized(tmp_path):
    llm = npqwen.load("tiny", weights="int8")
    llm.save(tmp_path)
    again = npqwen.load(tmp_path)
    ids = list(range(30, 50))
    assert_close(again.forward(ids), llm.forward(ids), 1e-5, "saved")


@pytest.mark.parametrize("fmt", ["int8", "q4_k"])
def test_quantize_writes_a_checkpoint_npqwen_loads_as_stored(fmt, blocky_dir, tmp_path, capsys):
    from npqwen.cli import main

    assert main(["quantize", str(blocky_dir), str(tmp_path / fmt), "--to", fmt]) == 0
    stored = npqwen.load(tmp_path / fmt)                       # auto: a quantized file stays as stored
    converted = npqwen.load(blocky_dir, weights=fmt)
    for name, w in converted.weights.items():
        if is_compact(w):
            assert stored.weights[name].format == w.format
            np.testing.assert_array_equal(np.asarray(stored.weights[name].storage), w.storage, err_msg=name)
    ids = list(range(9, 40))
    np.testing.assert_array_equal(stored.forward(ids), converted.forward(ids))
    files = {name: info.dtype for name, info in index_checkpoint(tmp_path / fmt).items()}
    assert files["model.layers.0.mlp.down_proj.weight"] == ("I8" if fmt == "int8" else "U8")
    assert ("model.layers.0.mlp.down_proj.weight_scale" in files) == (fmt == "int8")
    size = (tmp_path / fmt / "model.safetensors").stat().st_size
    print(f"{fmt}: {size:,} bytes, bf16 {(blocky_dir / 'model.safetensors').stat().st_size:,}")
    assert size < 0.6 * (blocky_dir / "model.safetensors").stat().st_size
    capsys.readouterr()
    assert main(["inspect", "--model", str(tmp_path / fmt)]) == 0
    shown = capsys.readouterr().out
    assert ("Q4_K" if fmt == "q4_k" else "I8") in shown and "weight_scale" not in shown
    assert "weights in memory by --weights format" in shown


def test_q5_k_planes_give_the_files_blocks_back_and_gguf_s_values():
    """Q5_K split into planes (Q4_K's, and the high bits eight to a byte) joins back into the file's blocks, bit for
    bit, and widens to what gguf.quants.dequantize gives, whole, by rows, by columns and a tensor-parallel part."""
    gguf = pytest.importorskip("gguf")
    from test_quants import random_blocks

    raw = random_blocks("Q5_K", np.random.default_rng(3), 40, 768)   # random bits, finite float16 d and dmin
    w = Ggml("Q5_K", raw.copy(), 768)
    assert w.planes[0].shape == (40, 768 // 2 + 768 // 8) and w.nbytes < raw.nbytes * 1.05
    np.testing.assert_array_equal(w.storage, raw)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K)
    np.testing.assert_array_equal(w.dequantize(), want)
    np.testing.assert_array_equal(w.take(np.array([7, 0, 39])), want[[7, 0, 39]])
    np.testing.assert_array_equal(w.columns(slice(256, 768)).dequantize(), want[:, 256:])
    np.testing.assert_array_equal(w.rows(slice(8, 24)).storage, raw[8:24])


def test_planes_split_a_run_of_rows_at_a_time_are_the_whole_matrix_s():
    """split_released (loading: each run of the file's rows split, then its pages released) makes the planes the
    format's split makes of the whole matrix, for runs that do not divide the rows."""
    from test_quants import random_blocks

    from npqwen.weights import PLANES, split_released

    for qtype in PLANES:
        raw = random_blocks(qtype, np.random.default_rng(4), 40, 512)
        for got, want in zip(split_released(qtype, raw, rows=16), PLANES[qtype][0](raw)):
            assert got.dtype == want.dtype and np.array_equal(got, want), qtype


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_products_per_sub_block_equal_the_widened_product(qtype):
    from test_quants import random_blocks

    from npqwen.weights import Compact

    blocks = random_blocks(qtype, np.random.default_rng(5), 300, 512)
    w = Ggml(qtype, blocks.copy(), 512)
    np.testing.assert_array_equal(w.storage, blocks)     # split into planes and joined back, bit for bit
    np.testing.assert_array_equal(w.dequantize(), quants.dequantize_rows(qtype, blocks, np.empty(w.shape, np.float32)))
    for T in (1, 5, 64):                                 # products per sub-block (Q6_K: at T=1)
        x = np.random.default_rng(T).standard_normal((T, 512)).astype(np.float32)
        want = x @ quants.dequantize_rows(qtype, w.storage, np.empty(w.shape, np.float32)).T   # the reference rule
        assert_close(w.linear(x), want, 1e-5, f"{qtype} T={T}")
        assert_close(Compact.linear(w, x), want, 1e-5, f"{qtype} T={T}, widened")   # Q8_0, Q4_0: from the planes


def test_products_per_sub_block_split_across_threads_equal_one_thread_s_bit_for_bit(monkeypatch):
    """sub_block_linear's blocks of rows split across a pool (weights.THREADS): the same blocks and products as in
    one thread, each part writing its own rows."""
    from test_quants import random_blocks

    from npqwen import weights

    monkeypatch.setattr(weights, "BLOCK_VALUES", 16 * 256)   # blocks of 16 rows: 300 rows are 19 blocks
    for qtype in ("Q8_0", "Q4_K"):
        w = Ggml(qtype, random_blocks(qtype, np.random.default_rng(9), 300, 256), 256)
        for T in (2, 32):                                    # the batched step's rows (one row: one thread)
            x = np.random.default_rng(T).standard_normal((T, 256)).astype(np.float32)
            monkeypatch.setattr(weights, "THREADS", 1)
            one = w.linear(x)
            monkeypatch.setattr(weights, "THREADS", 3)           # 19 blocks in parts of 6, 6 and 7
            split = w.linear(x)
            assert np.array_equal(split, one), f"{qtype} T={T}: max |diff| {np.abs(split - one).max()}"


def test_a_product_of_a_few_rows_in_small_blocks_equals_the_float64_product(monkeypatch):
    """ops.linear on 2 to 16 rows of x (the engine's step with a few sequences, a speculative verification): a
    float32 weight in blocks of rows, with one BLAS thread each product under OpenBLAS's 2^18 multiply-adds, with
    more block_rows rows; int8's and bfloat16's widened blocks in such products too. Every row of the output
    written, the blocks' edges included (1,003 rows, 51 to 819 a product)."""
    from npqwen import ops, weights
    from npqwen.weights import BFloat16, Int8, float32_to_bf16_bits

    rng = np.random.default_rng(3)
    w = rng.standard_normal((1003, 320)).astype(np.float32)
    for weight in (w, Int8.quantize(w), BFloat16(float32_to_bf16_bits(w))):
        exact_w = as_array(weight).astype(np.float64)
        for threads in (1, 3):                               # products under 2^18; blocks of block_rows
            monkeypatch.setattr(weights, "THREADS", threads)
            for T in (1, 2, 7, 16, 17):
                x = rng.standard_normal((T, 320)).astype(np.float32)
                y, exact = ops.linear(x, weight), x.astype(np.float64) @ exact_w.T
                err = np.abs(y - exact).max() / np.abs(exact).max()
                assert y.shape == (T, 1003) and y.flags.c_contiguous and err < 1e-6, \
                    f"{getattr(weight, 'format', 'float32')} T={T}, {threads} threads: relative {err:.2e}"


def test_stacked_rows_of_mixed_formats_widen_across_their_parts(monkeypatch):
    """Rows (qkv_proj, gate_up_proj) of parts in different formats, as a Q4_K_M file mixes them: a prefill's rows
    widen blocks that span the parts (int8's row scales beside parts without), a decode's rows go part by part."""
    from test_quants import random_blocks

    from npqwen import weights

    rng = np.random.default_rng(7)
    parts = [weights.Int8.quantize(rng.standard_normal((40, 256)).astype(np.float32)),
             Ggml("Q4_K", random_blocks("Q4_K", rng, 24, 256), 256),
             weights.quantize(rng.standard_normal((8, 256)).astype(np.float32), "bfloat16"),
             Ggml("Q6_K", random_blocks("Q6_K", rng, 16, 256), 256)]
    want_w = np.concatenate([p.dequantize() for p in parts])
    monkeypatch.setattr(weights, "PREFILL_BLOCKS", 1)
    monkeypatch.setattr(weights, "BLOCK_VALUES", 16 * 256)   # blocks of 16 rows: 32..48 and 64..80 span two parts
    for T in (3, 150):
        x = rng.standard_normal((T, 256)).astype(np.float32)
        assert_close(Rows(parts).linear(x), x @ want_w.T, 1e-5, f"mixed rows, T={T}")


def test_two_ranks_keep_their_rows_compact_and_compute_what_one_process_does(npqwen_tiny_dir, tmp_path):
    pytest.importorskip("mpi4py")
    from test_parallel import assert_same, probe

    one = probe(npqwen_tiny_dir, tmp_path / "one", 0, "--weights", "int8")[0]
    ranks = probe(npqwen_tiny_dir, tmp_path / "tp", 2, "--weights", "int8")
    assert_same(one, ranks, npqwen.load(npqwen_tiny_dir).config)   # tests/tolerance.py's bar for this model
    shapes = [json.loads(str(r["shapes"])) for r in ranks]
    assert shapes[1]["model.layers.0.self_attn.o_proj.weight"] == [64, 2 * 32]   # its 2 heads' columns only


def test_two_ranks_of_the_built_in_qwen3_5_convert_whole_matrices_then_keep_their_rows_and_columns(tmp_path):
    # tiny-qwen3.5 is made in memory: each rank must convert a matrix whole before it takes its part, or its
    # columns of out_proj / o_proj / down_proj get int8 row scales of their own (logits 9e-3 off one process's)
    pytest.importorskip("mpi4py")
    from test_parallel import assert_same, probe

    one = probe("tiny-qwen3.5", tmp_path / "one", 0, "--weights", "int8", "--lengths", "1,17")[0]
    ranks = probe("tiny-qwen3.5", tmp_path / "tp", 2, "--weights", "int8", "--lengths", "1,17")
    assert_same(one, ranks, npqwen.load("tiny-qwen3.5").config)
    shapes = json.loads(str(ranks[1]["shapes"]))
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == [2 * 16, 16]   # its q, k, v rows only
    assert shapes["model.layers.0.linear_attn.out_proj.weight"] == [16, 16]          # its value heads' columns


def test_a_split_off_the_block_boundaries_is_refused_with_what_to_do():
    w = Ggml.quantize("Q8_0", np.ones((4, 96), np.float32))
    assert w.columns(slice(32, 96)).shape == (4, 64)
    with pytest.raises(NpqwenError, match="blocks of 32 columns.*tensor-parallel size"):
        w.columns(slice(48, 96))


def test_on_cuda_the_strict_cupy_stand_in_gives_the_cpu_logits_and_real_cupy_names(npqwen_tiny_dir, monkeypatch):
    import strict_cupy

    ids = list(range(5, 40))
    want = {fmt: npqwen.load(npqwen_tiny_dir, weights=fmt).forward(ids) for fmt in ("bfloat16", "int8", "float16")}
    strict_cupy.install(monkeypatch)
    strict_cupy.used.clear()
    for fmt, logits in want.items():
        llm = npqwen.load(npqwen_tiny_dir, device="cuda", weights=fmt)
        assert_close(llm.forward(ids).get(), logits, 1e-5, f"{fmt} on the stand-in")
        assert llm.generate(ids, max_new_tokens=4, temperature=0).token_ids
    with pytest.raises(NpqwenError, match="run on the CPU"):
        npqwen.load(npqwen_tiny_dir, device="cuda", weights="q8_0")
    from test_cuda_standin import check_against, real_cupy

    problems = check_against(real_cupy(), dict(strict_cupy.used))
    assert not problems, "\n".join(problems)


def test_qwen3_0_6b_width_in_every_converted_format_and_rerank_on_a_compact_head(tmp_path):
    width = {**QWEN3_0_6B_WIDTH}
    path = write_npqwen_checkpoint(tmp_path, width, dtype="BF16")
    ids = np.random.default_rng(6).integers(0, width["vocab_size"], 24)
    for fmt in ("int8", "q8_0"):   # (bfloat16: against transformers above)
        llm = npqwen.load(path, weights=fmt)
        assert_close(llm.forward(ids), dequantized_twin(llm).forward(ids), 1e-5, f"0.6B width, {fmt}")
    reranker = npqwen.load("tiny-reranker", weights="int8")
    twin = npqwen.LLM(dequantized_twin(reranker), reranker.tokenizer, reranker.generation_defaults)
    twin.embedding_config = reranker.embedding_config
    docs = ["a cat sat", "the dog ran", "numbers"]
    got, want = reranker.rerank("a cat", docs), twin.rerank("a cat", docs)   # p(yes) per document
    print("rerank scores", got, want)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
