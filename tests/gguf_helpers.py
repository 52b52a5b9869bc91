"""Shared by the GGUF tests: llama.cpp from node-llama-cpp (tools/fetch_node_llama_cpp.sh), or a skip saying why."""
import platform
from pathlib import Path

import pytest

from tools import llama_cpp
from tools.llama_cpp import NODE_LLAMA_CPP, ROOT

LLAMA_CPP_BINS, LLAMA_CPP_SOURCE = llama_cpp.BINS, llama_cpp.SOURCE


def needs_llama_cpp():
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("node-llama-cpp's prebuilt llama.cpp used here is the linux-x64 one")
    if not LLAMA_CPP_BINS.is_dir() or not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp (node-llama-cpp 3.21.1) is not in {NODE_LLAMA_CPP}: run "
                    f"tools/fetch_node_llama_cpp.sh (needs npm) or set NPQWEN_NODE_LLAMA_CPP")


def llama_cpp_lib(name: str):
    """One of llama.cpp's prebuilt shared libraries (libggml-base.so, libllama.v0.4.0.so)."""
    needs_llama_cpp()
    return llama_cpp.library(name)


def made_once(what, make, work: Path) -> Path:
    """A folder of files `make(folder)` writes, made once and kept in .cache/gguf-tests/<key> (ignored by git;
    the key hashes `what` with the llama.cpp and torch versions that made them): converting and quantizing
    take tens of seconds, reading them back a few."""
    import hashlib
    import json
    import os
    import shutil

    import torch

    made_by = json.dumps([what, torch.__version__, (NODE_LLAMA_CPP / "llama.cpp" / ".git" / "HEAD").read_text()])
    root = ROOT / ".cache" / "gguf-tests" / hashlib.sha256(made_by.encode()).hexdigest()[:16]
    if not (root / "done").is_file():
        make(work)
        (work / "done").write_text(made_by)
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        if work.stat().st_dev == root.parent.stat().st_dev:
            os.replace(work, root)
        else:
            shutil.copytree(work, root)
    return root


def llama_quantize(src: Path, dst: Path, ftype: str) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, what `llama-quantize` runs) from an F32 GGUF."""
    needs_llama_cpp()
    return llama_cpp.quantize(src, dst, ftype)


def convert_hf_to_gguf(checkpoint: Path, out: Path, outtype: str = "f32", *flags: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (with its own gguf-py) on an HF checkpoint directory."""
    needs_llama_cpp()
    pytest.importorskip("sentencepiece", reason="convert_hf_to_gguf.py imports sentencepiece")
    return llama_cpp.convert(checkpoint, out, outtype, *flags)


# A small Qwen3 whose matrices have rows of 256 (a k-quant super-block), written straight by gguf's GGUFWriter
TINY_GGUF = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 max_position_embeddings=512)
LAYER_PARTS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
               "ffn_down": "down"}


def write_gguf(path: Path, qtype: str = "Q8_0", arch: str = "qwen3", tokenizer_model: str = "gpt2",
               qtypes: dict | None = None, seed: int = 0, tied: bool = True) -> Path:
    """A random tiny Qwen3 as a GGUF with llama.cpp's names and keys: matrices in `qtype` (`qtypes`: a
    tensor's own, by GGUF name), norms in F32, a byte-level tokenizer of 256 byte tokens and two specials."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from npqwen import quants

    c = TINY_GGUF
    D, F, H, K, Dh, V = (c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "vocab_size"))
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_key_length(Dh)
    w.add_value_length(Dh)
    w.add_rope_freq_base(c["rope_theta"])
    if arch == "qwen3moe":   # 4 experts of width 256, 2 per token, in every layer
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(256)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    byte_chars = [chr(b) for b in range(ord("!"), ord("~") + 1)] + [chr(b) for b in range(0xA1, 0xAD)] + \
        [chr(b) for b in range(0xAE, 0x100)]
    byte_chars += [chr(0x100 + n) for n in range(256 - len(byte_chars))]   # GPT-2's bytes_to_unicode, in some order
    tokens = byte_chars + ["<|endoftext|>", "<|im_end|>"] + [f"[PAD{i}]" for i in range(258, V)]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3] + [5] * (V - 258))
    w.add_token_merges([])
    w.add_eos_token_id(257)
    w.add_pad_token_id(256)
    w.add_bos_token_id(256)
    w.add_chat_template((ROOT / "npqwen" / "qwen3_chat_template.jinja").read_text())

    def add(name, shape, norm=False):
        x = (1 + 0.1 * rng.standard_normal(shape) if norm else 0.05 * rng.standard_normal(shape)).astype(np.float32)
        kind = "F32" if norm else (qtypes or {}).get(name, qtype)
        if kind == "F32":
            w.add_tensor(name, x)
        elif kind not in quants.BLOCKS:   # a format npqwen does not read: random bytes of its size
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
            raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block_size * type_size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
        else:
            raw = quants.quantize_rows(kind, x.reshape(-1, shape[-1])).reshape(*shape[:-1], -1)
            w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", (V, D))
    add("output_norm.weight", (D,), norm=True)
    if not tied:
        add("output.weight", (V, D))
    rows = {"q": H * Dh, "k": K * Dh, "v": K * Dh, "o": D, "gate": F, "up": F, "down": D}
    cols = {"q": D, "k": D, "v": D, "o": H * Dh, "gate": D, "up": D, "down": F}
    for i in range(c["num_hidden_layers"]):
        for norm, n in (("attn_norm", D), ("ffn_norm", D), ("attn_q_norm", Dh), ("attn_k_norm", Dh)):
            add(f"blk.{i}.{norm}.weight", (n,), norm=True)
        for gguf_name, part in LAYER_PARTS.items():
            if arch != "qwen3moe":
                add(f"blk.{i}.{gguf_name}.weight", (rows[part], cols[part]))
            elif not gguf_name.startswith("ffn_"):
                add(f"blk.{i}.{gguf_name}.weight", (rows[part], cols[part]))
            else:   # the experts stacked (E, rows, cols), as convert_hf_to_gguf.py writes Qwen3-MoE's
                add(f"blk.{i}.{gguf_name}_exps.weight", (4, D if part == "down" else 256, 256 if part == "down" else D))
        if arch == "qwen3moe":
            add(f"blk.{i}.ffn_gate_inp.weight", (4, D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
