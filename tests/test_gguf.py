"""GGUF files (npqwen/gguf_file.py): npqwen on a GGUF against npqwen's float32 on the same weights dequantized by
the `gguf` package (llama.cpp's reader), llama.cpp's names and metadata, Ollama's blobs, and bad files.

The files here are written by gguf's own GGUFWriter (fast, any format); tests/test_gguf_llama_cpp.py uses
real files from llama.cpp's converter and quantizer and compares with llama.cpp's logits."""
import json
import re
import shutil

import numpy as np
import pytest

import npqwen
from npqwen.errors import NpqwenError

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install gguf) reads GGUF files")

from gguf_helpers import write_gguf  # noqa: E402
from test_cli import one_error_line, run  # noqa: E402

PROMPT = [5, 77, 200, 13, 256, 91, 42, 3, 199, 120, 64, 7]


def dequantized_reference(gguf_path):
    """npqwen in float32 on the GGUF's tensors widened by gguf.quants.dequantize, put under the HF names that
    gguf-py's own tensor map gives (not npqwen's map)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from gguf.quants import dequantize

    from npqwen.checkpoint import allocate_weights, expected_shapes, tie_lm_head
    from npqwen.config import Qwen3Config
    from npqwen.gguf_file import config_dict, gguf_tensors, metadata, open_gguf
    from npqwen.llm import LLM
    from npqwen.model import Qwen3

    reader = open_gguf(gguf_path)   # gguf's GGUFReader (through an ndarray view of its map: faster)
    meta = metadata(reader)
    config = Qwen3Config.from_dict(config_dict(meta, gguf_tensors(reader, gguf_path), gguf_path))
    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == meta["general.architecture"])
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    by_name = {t.name: t for t in reader.tensors}
    shapes = expected_shapes(config, lm_head=not config.tie_word_embeddings)
    arrays, fused = allocate_weights(config, np, np.float32, shapes)
    for hf, array in arrays.items():
        base, _, suffix = hf.rpartition(".")
        expert = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)", base)   # a slice of the stacked experts
        t = by_name[f"{names.get_name(f'{expert[1]}.{expert[3]}' if expert else base)}.{suffix}"]
        value = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        array[...] = value[int(expert[2])] if expert else value
    return LLM(Qwen3(config, tie_lm_head(config, arrays), fused), None)


def assert_close(ours, ref, rtol, what):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= rtol, f"{what}: max |diff| {np.abs(ours - ref).max():.3g}, relative {rel:.3g} > {rtol}"


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K"])
def test_logits_equal_float32_on_the_dequantized_weights(qtype, tmp_path):
    """The matrices stay as the file stores them (memory-mapped; widened a block of rows at a time)."""
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype)
    llm = npqwen.load(path, weights="stored")
    q = llm.weights["model.layers.1.self_attn.q_proj.weight"]
    if qtype in ("Q8_0", "Q4_0", "Q4_K"):   # split once into planes: the integers (out, in) or (out, in/2), scales
        assert q.format == qtype and q.arrays[0].flags.c_contiguous and q.arrays[1].dtype == np.float32
        assert q.arrays[0].shape == (q.shape[0], q.shape[1] // (1 if qtype == "Q8_0" else 2))
    elif qtype != "F32":
        assert q.format == {"F16": "float16", "BF16": "bfloat16"}.get(qtype, qtype)
        assert isinstance(q.arrays[0].base, np.ndarray)   # a view of the file's bytes, not a copy
    ref = dequantized_reference(path)
    assert_close(llm.forward(PROMPT), ref.forward(PROMPT), 1e-5, f"{qtype} logits")
    assert llm.generate(PROMPT, 8).token_ids == ref.generate(PROMPT, 8).token_ids


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_qwen3_moe_stacked_experts(qtype, tmp_path):
    """llama.cpp's qwen3moe stacks each layer's experts as one (E, rows, cols) tensor; expert e is HF's experts.{e}."""
    path = write_gguf(tmp_path / "moe.gguf", qtype, arch="qwen3moe", qtypes={"blk.0.ffn_gate_inp.weight": "F32"})
    llm = npqwen.load(path)
    assert (llm.config.num_experts, llm.config.num_experts_per_tok, llm.config.moe_intermediate_size) == (4, 2, 256)
    assert llm.weights["model.layers.1.mlp.experts.3.down_proj.weight"].format == qtype
    ref = dequantized_reference(path)
    assert_close(llm.forward(PROMPT), ref.forward(PROMPT), 1e-5, f"qwen3moe {qtype} logits")


def test_names_are_hf_names_and_the_file_stays_mapped(tmp_path):
    from npqwen.checkpoint import expected_shapes
    from npqwen.gguf_file import gguf_tensors, hf_name, open_gguf

    path = write_gguf(tmp_path / "tiny.gguf", "Q8_0", tied=False)
    llm = npqwen.load(path)
    assert set(expected_shapes(llm.config)) <= set(llm.weights)
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down_exps.weight") == "model.layers.0.mlp.experts.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight" and hf_name("rope_freqs.weight") is None
    tensors = gguf_tensors(open_gguf(path), path)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.qtype == "Q8_0" and q.shape == (256, 256) and q.raw.shape == (256, 256 // 32 * 34)
    assert isinstance(q.raw.base, np.ndarray) and q.raw.nbytes < 256 * 256 * 4   # a view of the file's bytes
    code, out, err = run("inspect", "--model", str(path))
    assert code == 0, err
    assert "(GGUF)" in out and "model.layers.1.self_attn.q_proj.weight           [256, 256]       Q8_0" in out


def test_the_reader_reads_every_field_as_gguf_s_own_reader_does(tmp_path):
    """open_gguf's reader reads arrays (the token list, the token types, an empty merge list) in one loop: every
    field's parts, data indices, types and contents are GGUFReader's."""
    from gguf import GGUFReader

    from npqwen.gguf_file import open_gguf

    path = write_gguf(tmp_path / "tiny.gguf", "Q8_0")
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.data, got.types, len(got.parts)) == (want.offset, want.data, want.types,
                                                                     len(want.parts)), key
        for a, b in zip(got.parts, want.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), key
        assert np.array_equal(np.asarray(got.contents()), np.asarray(want.contents())), key
    assert [(t.name, t.data_offset) for t in ours.tensors] == [(t.name, t.data_offset) for t in theirs.tensors]


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_another_architecture_is_named(arch, tmp_path):
    path = write_gguf(tmp_path / f"{arch}.gguf", "Q8_0", arch=arch)
    with pytest.raises(NpqwenError, match=f"a GGUF of architecture '{arch}'; npqwen runs Qwen3: 'qwen3', 'qwen3moe'"):
        npqwen.load(path)


@pytest.mark.parametrize("qtype", ["IQ2_XS", "TQ1_0"])
def test_a_format_npqwen_does_not_read_is_named_with_the_list(qtype, tmp_path):
    path = write_gguf(tmp_path / "odd.gguf", "Q8_0", qtypes={"blk.1.ffn_up.weight": qtype})
    with pytest.raises(NpqwenError, match=f"blk.1.ffn_up.weight is stored as {qtype}, a GGUF format npqwen does not "
                                          f"read; it reads F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K"):
        npqwen.load(path)


def test_a_truncated_file_and_a_non_bpe_tokenizer_are_one_line_each(tmp_path):
    path = write_gguf(tmp_path / "whole.gguf", "Q4_0")
    data = path.read_bytes()
    for n, name in ((len(data) // 2, "half"), (len(data) - 100, "nearly"), (2000, "header")):
        cut = tmp_path / f"{name}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(NpqwenError, match="not a complete GGUF file .* it may be truncated"):
            npqwen.load(cut)
    sentencepiece = write_gguf(tmp_path / "spm.gguf", "Q4_0", tokenizer_model="llama")
    with pytest.raises(NpqwenError, match="tokenizer is 'llama' .* npqwen reads the byte-level BPE tokenizer"):
        npqwen.load(sentencepiece)
    code, _, err = run("generate", "--model", str(tmp_path / "half.gguf"), "--prompt", "hi")
    one_error_line(code, err, "it may be truncated")


def fake_ollama(root, gguf_path, name="qwen3", tag="tiny"):
    """Ollama's layout: a manifest naming the model layer by digest, the GGUF as blobs/sha256-<hex>."""
    import hashlib

    digest = "sha256:" + hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf_path, root / "blobs" / digest.replace(":", "-"))
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00", "size": 1},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": gguf_path.stat().st_size}]}))
    return root


def test_ollama_names_find_the_blob_and_a_missing_one_says_pull(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_K")
    root = fake_ollama(tmp_path / "ollama", path)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    llm = npqwen.load("ollama:qwen3:tiny")
    np.testing.assert_array_equal(llm.forward(PROMPT), npqwen.load(path).forward(PROMPT))
    with pytest.raises(NpqwenError, match=r"Ollama has not pulled qwen3:8b .* run `ollama pull qwen3:8b`"):
        npqwen.load("ollama:qwen3:8b")
    with pytest.raises(NpqwenError, match=r"Ollama has not pulled qwen3:latest"):
        npqwen.load("ollama:qwen3")
    env = {"OLLAMA_MODELS": str(root)}
    code, _, err = run("generate", "--model", "ollama:qwen3:tiny", "--prompt", "hi", "-n", "3", env=env)
    assert code == 0, err
    code, _, err = run("generate", "--model", "ollama:qwen3:8b", "--prompt", "hi", env=env)
    one_error_line(code, err, "Ollama has not pulled qwen3:8b")


def test_two_ranks_of_a_gguf_compute_what_one_process_does(tmp_path):
    """Tensor parallelism on a GGUF: each rank keeps its rows of the mapped Q8_0 blocks (its columns copied on
    whole blocks); tests/parallel_probe.py's calls on 2 ranks equal one process's."""
    pytest.importorskip("mpi4py")
    from test_parallel import assert_same, probe

    path = write_gguf(tmp_path / "tp.gguf", "Q8_0", tied=False)
    one = probe(path, tmp_path / "one")[0]
    ranks = probe(path, tmp_path / "tp", 2)
    assert_same(one, ranks, npqwen.load(path).config)   # tests/tolerance.py's bar for this model
    shapes = [json.loads(str(r["shapes"])) for r in ranks]
    assert shapes[0]["model.layers.0.self_attn.q_proj.weight"] == [2 * 64, 256]   # 2 of the 4 heads
    assert shapes[1]["model.layers.0.mlp.down_proj.weight"] == [256, 256]          # half the width, as columns


def test_compare_runs_hf_transformers_on_the_dequantized_weights(tmp_path):
    """npqwen compare on a GGUF: HF transformers reads its weights saved widened to float32; every step agrees."""
    pytest.importorskip("transformers")
    from npqwen.compare import compare, relative

    llm = npqwen.load(write_gguf(tmp_path / "tiny.gguf", "Q4_K"))
    rows = compare(llm, PROMPT)
    assert len(rows) >= 30, [r["name"] for r in rows]   # trace names HF's modules, as for a checkpoint directory
    assert max(relative(r) for r in rows) < 1e-4, max(rows, key=relative)


def test_each_bad_gguf_is_one_line_from_the_cli(tmp_path, capsys):
    """Issue 37's bad input at the CLI (in process): a format npqwen does not read, another architecture, a tokenizer
    that is not BPE: exit 1 and one `npqwen: error:` line naming it (truncated files and Ollama names: above)."""
    from npqwen.cli import main

    cases = {write_gguf(tmp_path / "iq.gguf", "Q8_0", qtypes={"blk.1.ffn_up.weight": "IQ2_XS"}):
             "stored as IQ2_XS, a GGUF format npqwen does not read; it reads F32, F16, BF16, Q8_0",
             write_gguf(tmp_path / "llama.gguf", "Q8_0", arch="llama"): "a GGUF of architecture 'llama'",
             write_gguf(tmp_path / "spm.gguf", "Q4_0", tokenizer_model="llama"): "the GGUF's tokenizer is 'llama'"}
    for path, message in cases.items():
        code = main(["generate", "--model", str(path), "--prompt", "hi", "-n", "1"])
        one_error_line(code, capsys.readouterr().err, message)


def test_reordered_heads_compute_the_reordered_matrix():
    """ReorderedHeads (a qwen35 GGUF's tiled value heads, kept as stored): x @ W^T, d_y @ W (an input's gradient
    through the frozen matrix: LoRA on a GGUF), rows, take and dequantize are those of the stored matrix with its
    rows and columns taken in HF's order; a tensor-parallel column split is refused."""
    from npqwen.gguf_file import ReorderedHeads
    from npqwen.weights import Ggml

    rng = np.random.default_rng(0)
    stored = Ggml.quantize("Q8_0", rng.standard_normal((48, 64)).astype(np.float32))   # (out, in)
    rows, cols = rng.permutation(48), rng.permutation(64)
    w, want = ReorderedHeads(stored, rows, cols), stored.dequantize()[rows][:, cols]
    x = rng.standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_array_equal(w.dequantize(), want)
    np.testing.assert_allclose(w.linear(x), x @ want.T, rtol=1e-5, atol=1e-5)
    d_y = rng.standard_normal((5, 48)).astype(np.float32)
    np.testing.assert_allclose(w.linear_backward(d_y), d_y @ want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ReorderedHeads(stored, None, cols).linear_backward(d_y),
                               d_y @ stored.dequantize()[:, cols], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(w.take(np.array([3, 0, 47])), want[[3, 0, 47]])
    np.testing.assert_array_equal(w.rows(slice(8, 24)).dequantize(), want[8:24])
    only_rows = ReorderedHeads(stored, rows, None)
    np.testing.assert_allclose(only_rows.linear_backward(d_y), d_y @ stored.dequantize()[rows], rtol=1e-5, atol=1e-5)
    assert isinstance(only_rows.rows(slice(0, 16)), Ggml)   # a rank's rows: the stored bytes gathered, plain again
    with pytest.raises(NpqwenError, match="cannot take columns of a Q8_0 matrix whose value heads llama.cpp reordered"):
        w.columns(slice(0, 32))
