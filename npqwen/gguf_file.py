"""GGUF files (llama.cpp's format, what Ollama pulls): the config, tokenizer and weights of a Qwen in one file.

A GGUF holds key/value metadata and tensors. The `gguf` package (llama.cpp's own reader) memory-maps the
file; every tensor stays the reader's view of its bytes, in its stored ggml format (`npqwen/quants.py`),
and only a block of rows at a time is ever widened. This module turns what llama.cpp's converter
(`convert_hf_to_gguf.py`) wrote back into what npqwen reads from a Hugging Face checkpoint:

- the config: `qwen3.embedding_length` -> `hidden_size`, ... (`config_dict`), for llama.cpp's `qwen3`,
  `qwen3moe`, `qwen35`, `qwen35moe` (Qwen3.5-MoE: Qwen3.5's layers with Qwen3-MoE's stacked experts and a shared
  expert) and `qwen2` (Qwen2 / Qwen2.5: its q/k/v biases `blk.N.attn_q.bias` are HF's `q_proj.bias`);
- the tokenizer and chat template: `tokenizer.ggml.tokens`, `.merges`, `.token_type` and
  `tokenizer.chat_template` -> a byte-level BPE `tokenizers.Tokenizer` (`gguf_tokenizer`);
- the tensors under their HF names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`
  (`hf_name`), each a `GGUFTensor` (its stored rows, its qtype, its HF shape). llama.cpp's converter
  writes Qwen3's q/k rows as HF has them (it permutes rows only for LLaMA-style interleaved RoPE);
- Qwen3.5's value heads back in HF's order where the converter tiled them (more value heads than key heads:
  `value_head_order`), the matrices kept as stored (`ReorderedHeads`).

A GGUF matrix of ggml shape [cols, rows] is the HF (rows, cols) matrix: ggml lists the fastest axis first.
`ollama:NAME[:TAG]` finds the GGUF blob of a model Ollama has pulled (`ollama_blob`).
"""
import json
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import quants
from .backend import to_numpy, xp_of
from .errors import NpqwenError
from .weights import Compact, Rows, as_array, is_compact

# general.architecture as llama.cpp writes it -> HF model_type
ARCHITECTURES = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",
                 "qwen2": "qwen2", "qwen4exp": "qwen4_exp_text"}

# llama.cpp's tensor names (gguf-py's tensor_mapping for QWEN3 / QWEN3MOE) -> HF's, per layer and whole-model
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",   # qwen35's name for it
    # qwen35's Gated DeltaNet layers (HF's linear_attn); ssm_a and ssm_dt.bias: see hf_name
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",   # the MoE router
    # the experts of a sparse layer, stacked (E, rows, cols): expert e is HF's mlp.experts.{e}.*
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # qwen35moe and qwen4exp: the shared expert and its gate; qwen4exp: the two hyper-connections, QSA's indexer
    # (its q and k rows apart: HF's index_qk_proj is the two stacked, load_gguf_weights), the PLE layer (its table:
    # ple_table_name)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    **{f"hc_{g}_{part}": f"{block}_hyper_connection.{hf}" for g, block in (("attn", "attn"), ("ffn", "mlp"))
       for part, hf in (("norm", "hc_norm"), ("down", "input_mix_weight_down"), ("up", "input_mix_weight_up"),
                        ("inject", "block_inject_weight"))},
    "indexer.q_proj": "self_attn.indexer.q_proj", "indexer.k_proj": "self_attn.indexer.k_proj",
    "indexer.q_norm": "self_attn.indexer.q_layernorm", "indexer.k_norm": "self_attn.indexer.k_layernorm",
    "ple_key": "ple.key_proj", "ple_value": "ple.value_proj", "ple_norm_key": "ple.norm_key",
    "ple_norm_query": "ple.norm_query", "ple_norm_conv": "ple.norm_conv", "ple_conv1d": "ple.conv1d",
}
MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
               "output_hc_norm": "model.hyper_connection_mixer.hc_norm",   # qwen4exp's final mixing
               "output_hc_down": "model.hyper_connection_mixer.input_mix_weight_down",
               "output_hc_up": "model.hyper_connection_mixer.input_mix_weight_up"}

# tokenizer.ggml.token_type: 1 normal (in the BPE vocabulary), 3 control (special), 4 user defined
# (an added token that is not special: <think>, <tool_call>), 5 unused (the padding up to vocab_size)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# tokenizer.ggml.pre -> the pre-tokenizer's split regex (llama.cpp's llama-vocab.cpp; Qwen2's, from tokenizer.json)
PRE_TOKENIZERS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


class GGUFTensor(NamedTuple):
    """One tensor as the file stores it: `raw` is the reader's memory-mapped view, (rows, row bytes) uint8
    for a matrix ((E, rows, row bytes) for stacked experts), `shape` the HF shape, `qtype` its ggml format."""
    name: str          # llama.cpp's name (blk.0.attn_q.weight)
    qtype: str         # "Q4_K", "F32", ... (quants.BLOCKS)
    shape: tuple       # HF shape: (rows, cols), (E, rows, cols) or (n,)
    raw: np.ndarray    # uint8 bytes, rows first

    def dequantize(self) -> np.ndarray:
        """The whole tensor widened to float32 (for small tensors: norms, one expert, tests)."""
        out = np.empty(self.shape, np.float32)
        rows = out.reshape(-1, self.shape[-1])
        quants.dequantize_rows(self.qtype, self.raw.reshape(rows.shape[0], -1), rows)
        return out


def is_gguf(path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes (Ollama's blobs have no .gguf suffix)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


DTYPES = {t: np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
                                   np.float32, np.float64, np.bool_)}


def open_gguf(path):
    """llama.cpp's GGUFReader over the file, memory-mapped; a file it cannot read is one clear error."""
    try:
        from gguf import GGUFReader, GGUFValueType
    except ImportError:
        raise NpqwenError(f"{path}: reading GGUF files needs the gguf package: pip install 'npqwen[gguf]' "
                          f"(or pip install gguf)") from None

    class Reader(GGUFReader):
        """GGUFReader reading through a plain ndarray view of its np.memmap: the same bytes, mapped the same way,
        without np.memmap's cost on each of the ~10^6 small slices a 151k-token vocabulary takes (3.5x faster);
        and in a file of the machine's byte order, each value a plain view of its bytes (2x faster again)."""

        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)
            if self.byte_order == "I" and override_order is None:   # GGUFReader's "as the machine has it"
                dtype = DTYPES.get(dtype) or np.dtype(dtype)
                return self.data[offset:offset + dtype.itemsize * int(count)].view(dtype)
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs, raw_type):
            """An array (a tokenizer's 151,936 tokens and token types, its 151,387 merges) read in one loop: the
            parts GGUFReader makes, views of the map (each string's length and bytes; each number), without its
            call per item (the file opens 4x faster)."""
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]   # item type, count
            item, count, offs = GGUFValueType(parts[0][0]), int(parts[1][0]), orig_offs + 12
            number = self.gguf_scalar_to_np.get(item)
            if number is not None:   # one view of all, then each item's own
                every = self._get(offs, number, count)
                parts += [every[i:i + 1] for i in range(count)]
                offs += every.nbytes
            elif item == GGUFValueType.STRING:
                data, mapped, length = self.data, memoryview(self.data), np.dtype(np.uint64)
                for _ in range(count):
                    n = int.from_bytes(mapped[offs:offs + 8], sys.byteorder)
                    parts += (data[offs:offs + 8].view(length), data[offs + 8:offs + 8 + n])
                    offs += 8 + n
            else:   # an array of arrays
                return super()._get_field_parts(orig_offs, raw_type)
            idxs = list(range(2, len(parts))) if number is not None else list(range(3, len(parts), 2))
            return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY] + ([item] if count else [])

    try:
        return Reader(path, "r")
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise NpqwenError(f"{path}: not a complete GGUF file ({str(e)[:160]}); it may be truncated: download or "
                          f"pull it again") from None


def metadata(reader) -> dict:
    """Every key/value of the file but the tokenizer's lists, as Python values."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.") and key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                              "tokenizer.ggml.token_type", "tokenizer.ggml.scores")}


def architecture(meta: dict, path) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise NpqwenError(f"{path}: a GGUF of architecture {arch!r}; npqwen runs Qwen3: "
                          f"{', '.join(repr(a) for a in ARCHITECTURES)} (llama.cpp's names for Qwen3, Qwen3-MoE, "
                          f"Qwen3.5, Qwen3.5-MoE and Qwen2 / Qwen2.5)")
    return arch


def decimal(value: float) -> float:
    """A float32 the file stores, as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def config_dict(meta: dict, tensors: dict, path) -> dict:
    """The GGUF metadata as HF config.json keys (convert_hf_to_gguf.py's set_gguf_parameters, read back)."""
    arch = architecture(meta, path)

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise NpqwenError(f"{path}: the GGUF metadata has no {arch}.{name}; the file is incomplete")
        return value

    embedding = tensors["model.embed_tokens.weight"]
    config = dict(
        model_type=ARCHITECTURES[arch], hidden_size=key("embedding_length"), num_hidden_layers=key("block_count"),
        intermediate_size=key("feed_forward_length", 0) or key("expert_feed_forward_length"),
        num_attention_heads=key("attention.head_count"), num_key_value_heads=key("attention.head_count_kv"),
        head_dim=key("attention.key_length", key("embedding_length") // key("attention.head_count")),   # qwen2: none
        rms_norm_eps=decimal(key("attention.layer_norm_rms_epsilon")),
        rope_theta=decimal(key("rope.freq_base")), max_position_embeddings=key("context_length"),
        vocab_size=embedding.shape[0], tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"))
    if arch == "qwen3moe":   # llama.cpp always renormalises Qwen3-MoE's top-k router weights
        config.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length"), norm_topk_prob=True)
    if arch == "qwen35moe":   # every layer sparse, as qwen3moe's, and a shared expert (HF's intermediate_size)
        config.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length"), norm_topk_prob=True,
                      shared_expert_intermediate_size=key("expert_shared_feed_forward_length"),
                      intermediate_size=key("expert_shared_feed_forward_length"))
    if arch in ("qwen35", "qwen35moe", "qwen4exp"):   # Qwen3.5's Gated DeltaNet layers and its partial, multimodal RoPE
        Hv = key("ssm.time_step_rank")
        config.update(linear_conv_kernel_dim=key("ssm.conv_kernel"), linear_key_head_dim=key("ssm.state_size"),
                      linear_num_key_heads=key("ssm.group_count"), linear_num_value_heads=Hv,
                      linear_value_head_dim=key("ssm.inner_size") // Hv,
                      full_attention_interval=key("full_attention_interval"),
                      rope_parameters={"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                                       "partial_rotary_factor": key("rope.dimension_count") / config["head_dim"],
                                       "mrope_section": list(key("rope.dimension_sections"))[:3],
                                       "mrope_interleaved": True})
    if arch == "qwen4exp":
        config.update(qwen4exp_config(meta, key, tensors, config, path))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor"),
                                  "original_max_position_embeddings": key("rope.scaling.original_context_length")}
    return config


def qwen4exp_config(meta: dict, key, tensors: dict, config: dict, path) -> dict:
    """qwen4exp's keys (llama.cpp's conversion/qwen4exp.py, set_gguf_parameters) as Qwen4ExpTextConfig's.

    Read as llama.cpp reads them: a layer is Gated DeltaNet unless it is every full_attention_interval-th (or as
    attention.recurrent_layers says); QSA's block size is the attention layers' attention.compress_ratios entry.
    The converter writes 0 there for transformers' checkpoints (whose layer type is "indexed_attention", not the
    "full_attention" it looks for), and llama.cpp then attends to every token: so does npqwen (blocks of one token,
    a budget of the whole context), with a warning, since transformers keeps only the indexer_budget tokens it picks.
    Gated DeltaNet's output gate is a sigmoid, as llama.cpp's qwen4exp always computes it (transformers' default is
    SiLU: a checkpoint whose config.json leaves output_gate_type unset converts to a file that llama.cpp, and npqwen
    after it, runs with another gate). The PLE hash is the file's own (its multipliers and head sizes), for its one
    PLE layer, as llama.cpp reads it;
    the multimodal RoPE sections are left out: for text all three positions are equal, which is plain RoPE."""
    L, arch = config["num_hidden_layers"], meta["general.architecture"]
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    interval = key("full_attention_interval", 4)
    linear = [bool(recurrent[i]) for i in range(L)] if recurrent is not None else [(i + 1) % interval != 0
                                                                                    for i in range(L)]
    ratios = [int(r) for r in np.atleast_1d(key("attention.compress_ratios", [0] * L))]
    ratios = ratios * L if len(ratios) == 1 else ratios
    attention = [i for i in range(L) if not linear[i]]
    ratio = {ratios[i] for i in attention}
    if len(ratio) > 1:
        raise NpqwenError(f"{path}: attention.compress_ratios gives the QSA layers {attention} different block sizes "
                          f"{sorted(ratio)}; npqwen's QSA (as transformers') has one indexer_compress_ratio")
    ratio, budget = (ratio or {0}).pop(), key("attention.indexer.top_k")
    if ratio == 0:
        import warnings
        warnings.warn(f"{path}: attention.compress_ratios is 0 for the attention layers {attention}, so llama.cpp "
                      f"attends to every token there, not to the indexer_budget ({budget}) it picks; npqwen does "
                      f"the same (llama.cpp's converter writes 0 for transformers' checkpoints); prompts longer than "
                      f"{budget} tokens then differ from transformers' QSA", stacklevel=4)
        ratio, budget = 1, config["max_position_embeddings"]
    out = dict(model_type="qwen4_exp_text", num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
               moe_intermediate_size=key("expert_feed_forward_length"),
               shared_expert_intermediate_size=key("expert_shared_feed_forward_length"),
               layer_types=["linear_attention" if lin else "full_attention" for lin in linear],
               hc_count=key("hyper_connection.count"), hc_lowrank=key("hyper_connection.low_rank"),
               indexer_n_heads=key("attention.indexer.head_count"), indexer_kv_heads=1,
               indexer_head_dim=key("attention.indexer.key_length"), indexer_budget=budget,
               indexer_compress_ratio=ratio, ple_layer_ids=[],
               output_gate_type="sigmoid")   # llama.cpp's qwen4exp gates Gated DeltaNet's output so (the file says not)
    out["rope_parameters"] = {k: v for k, v in config["rope_parameters"].items() if not k.startswith("mrope")}
    layers = [int(i) for i in np.atleast_1d(meta.get(f"{arch}.ple.layers", []))]
    if layers:
        sizes = [int(n) for n in key("ple.head_vocab_sizes")]
        heads = key("ple.heads_per_ngram")
        table = tensors[ple_table_name(layers[0])]
        out.update(ple_layer_ids=[i + 1 for i in layers], ngram_size=key("ple.ngram_size"), heads_per_ngram=heads,
                   ple_conv_kernel_size=key("ple.conv_kernel"),
                   ple_embed_dim=len(sizes) * key("embedding_length_per_layer_input"),
                   ngram_vocab_size_base=sizes[0],   # the heads' primes are the ones after it
                   make_ngram_vocab_size_divisible_by=table.shape[0],   # the table's rows, padded as the file has them
                   ple_multipliers=[int(m) for m in key("ple.layer_multipliers")])
        if key("ple.eos_token_id") != config["eos_token_id"]:
            raise NpqwenError(f"{path}: the PLE hash resets on token {key('ple.eos_token_id')} but the tokenizer's "
                              f"end of text is {config['eos_token_id']}; npqwen resets on the end of text")
    return out


def ple_table_name(layer: int) -> str:
    """HF's name of the PLE table of a 0-indexed layer: qwen4exp's per_layer_token_embd (one PLE layer)."""
    return f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"


def hf_name(name: str, ple_layer: int | None = None) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for a name npqwen does not use.
    `ple_layer`: qwen4exp's one PLE layer, whose table per_layer_token_embd.weight is."""
    if name == "per_layer_token_embd.weight":
        return None if ple_layer is None else ple_table_name(ple_layer)
    bare = re.fullmatch(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)", name)   # qwen35: A (as -exp(A_log)) and dt's bias
    if bare:
        return f"model.layers.{bare[1]}.linear_attn.{'A_log' if bare[2] == 'ssm_a' else 'dt_bias'}"
    base, _, suffix = name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.([\w.]+)", base)
    if match and match.group(2) in LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}.{suffix}"
    return f"{MODEL_NAMES[base]}.{suffix}" if base in MODEL_NAMES else None


def gguf_tensors(reader, path, meta: dict | None = None) -> dict[str, GGUFTensor]:
    """Every tensor npqwen uses, under its HF name, as the file stores it (nothing is read yet)."""
    tensors = {}
    ple = [int(i) for i in np.atleast_1d((meta or {}).get("qwen4exp.ple.layers", []))]
    for t in reader.tensors:
        name = hf_name(t.name, ple[0] if ple else None)
        if name is None:
            continue
        qtype = t.tensor_type.name
        if qtype not in quants.BLOCKS:
            raise NpqwenError(f"{path}: tensor {t.name} is stored as {qtype}, a GGUF format npqwen does not read; "
                              f"it reads {', '.join(quants.BLOCKS)} (a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file)")
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))   # ggml [cols, rows, E] -> HF (E, rows, cols)
        if name.endswith("conv1d.weight"):   # qwen35 squeezed HF's (C, 1, W) convolutions to (C, W)
            shape = (shape[0], 1, shape[1])
        if name.endswith("shared_expert_gate.weight"):   # HF's (1, D), which llama.cpp's quantizer writes (D,)
            shape = (1, shape[-1])
        raw = t.data.view(np.uint8).reshape(*shape[:-1], quants.row_bytes(qtype, shape[-1]))
        tensors[name] = GGUFTensor(t.name, qtype, shape, raw)
    if "model.embed_tokens.weight" not in tensors:
        raise NpqwenError(f"{path}: the GGUF has no token_embd.weight; it is not a whole model")
    return tensors


def gguf_tokenizer(reader, meta: dict, path):
    """tokenizer.ggml.* and tokenizer.chat_template -> npqwen's Tokenizer (byte-level BPE, as tokenizer.json)."""
    from tokenizers import Tokenizer as Backend

    from .tokenizer import Tokenizer

    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2":
        raise NpqwenError(f"{path}: the GGUF's tokenizer is {model!r} (tokenizer.ggml.model); npqwen reads the "
                          f"byte-level BPE tokenizer ('gpt2') that Qwen3's GGUF files hold")
    if pre not in PRE_TOKENIZERS:
        raise NpqwenError(f"{path}: the GGUF's pre-tokenizer is {pre!r} (tokenizer.ggml.pre); npqwen reads "
                          f"{', '.join(map(repr, PRE_TOKENIZERS))} (Qwen3's)")
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise NpqwenError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.tokens); npqwen needs one in the file")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in reader.fields \
        else [NORMAL] * len(tokens)
    merges = reader.fields["tokenizer.ggml.merges"].contents() if "tokenizer.ggml.merges" in reader.fields else []
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec = {   # the tokenizer.json a Qwen3 checkpoint ships, rebuilt from the GGUF's lists
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == CONTROL}
                         for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == NORMAL},
                  "merges": merges},
    }
    backend = Backend.from_str(json.dumps(spec))
    special = {f"{what}_token": tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
               for what, key in (("eos", "eos"), ("pad", "padding"))
               if meta.get(f"tokenizer.ggml.{key}_token_id") is not None}
    if meta.get("tokenizer.ggml.add_bos_token") and meta.get("tokenizer.ggml.bos_token_id") is not None:
        special["bos_token"] = tokens[meta["tokenizer.ggml.bos_token_id"]]
    return Tokenizer(backend, meta.get("tokenizer.chat_template"), special)


def read_config(path):
    """(Qwen3Config, HF name -> GGUFTensor) of a GGUF file, without its tokenizer (npqwen inspect)."""
    from .config import Qwen3Config

    reader = open_gguf(path)
    meta = metadata(reader)
    architecture(meta, path)
    tensors = gguf_tensors(reader, path, meta)
    return Qwen3Config.from_dict(config_dict(meta, tensors, path), source=str(path)), tensors


def read_gguf(path):
    """(config dict, HF name -> GGUFTensor, Tokenizer) of a GGUF file, its tensors left memory-mapped."""
    reader = open_gguf(path)
    meta = metadata(reader)
    architecture(meta, path)
    tensors = gguf_tensors(reader, path, meta)
    return config_dict(meta, tensors, path), tensors, gguf_tokenizer(reader, meta, path)


def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_blob(name: str) -> Path:
    """The GGUF blob of a model Ollama has pulled: "qwen3:8b", "qwen3" (tag latest), "user/model:tag".

    Ollama keeps a manifest per model at manifests/<host>/<namespace>/<model>/<tag> (host
    registry.ollama.ai, namespace library by default) under ~/.ollama/models or $OLLAMA_MODELS; its layer
    of mediaType application/vnd.ollama.image.model names the GGUF as blobs/sha256-<hex>.
    """
    model, _, tag = name.partition(":")
    parts = model.split("/")
    if not model or len(parts) > 3 or not all(parts):
        raise NpqwenError(f"ollama:{name}: not an Ollama model name; use ollama:MODEL[:TAG], e.g. ollama:qwen3:8b")
    parts = ["registry.ollama.ai", "library"][:3 - len(parts)] + parts
    root = ollama_models_dir()
    manifest = root.joinpath("manifests", *parts, tag or "latest")
    if not manifest.is_file():
        raise NpqwenError(f"ollama:{name}: Ollama has not pulled {model}:{tag or 'latest'} (no manifest "
                          f"{manifest}); run `ollama pull {model}:{tag or 'latest'}`, or set OLLAMA_MODELS to "
                          f"where Ollama keeps its models")
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers
                      if layer.get("mediaType") == "application/vnd.ollama.image.model")
    except (ValueError, KeyError, TypeError, StopIteration):
        raise NpqwenError(f"ollama:{name}: the manifest {manifest} names no model layer; pull it again") from None
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise NpqwenError(f"ollama:{name}: the manifest names {blob}, which is missing; run "
                          f"`ollama pull {model}:{tag or 'latest'}` again")
    return blob


def hf_tensors(tensors: dict[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """Stacked experts split into HF's per-expert names: mlp.experts.gate_proj (E, I, D) -> mlp.experts.{e}.gate_proj
    (I, D), each a view into the file's bytes."""
    out = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, _, part = name.partition(".mlp.experts.")
            for e in range(t.shape[0]):
                out[f"{prefix}.mlp.experts.{e}.{part}"] = GGUFTensor(t.name, t.qtype, t.shape[1:], t.raw[e])
        else:
            out[name] = t
    return out


def stored_weight(t: GGUFTensor):
    """A GGUF matrix as npqwen/weights.py keeps it, over the file's mapped bytes: ggml blocks as Ggml, F16 and BF16
    as Float16 and BFloat16, F32 as a float32 array."""
    from .weights import BFloat16, Float16, Ggml

    if t.qtype == "F32":
        return t.raw.view(np.float32)
    if t.qtype == "F16":
        return Float16(t.raw.view(np.float16))
    if t.qtype == "BF16":
        return BFloat16(t.raw.view(np.uint16))
    return Ggml(t.qtype, t.raw, t.shape[-1])


def hf_value(config, name: str, value: np.ndarray) -> np.ndarray:
    """A small tensor as HF holds it. convert_hf_to_gguf.py stores Qwen3.5's (1 + weight) norms as 1 + weight
    and A_log as -exp(A_log); undone here (to float32 rounding)."""
    if not config.hybrid:
        return value
    if name.endswith(".A_log"):
        return np.log(-value)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight") or ".ple.norm_" in name:
        return value - np.float32(1)   # (qwen4exp: the hyper-connections', the indexer's and PLE's norms too)
    return value


def value_head_order(config, name: str) -> tuple:
    """(rows, columns) of HF's `name` in a qwen35 GGUF: index arrays, HF's row i is the file's row rows[i]
    (None: the same order). With more value heads than key heads (Hv = r Hk), HF groups the value heads by the
    key head they read, [k0: v0 .. v(r-1), k1: v0 ...]; llama.cpp's converter (_LinearAttentionVReorderBase in
    its conversion/qwen.py) tiles them, [v0: k0 .. k(Hk-1), v1: ...], so that ggml broadcasts the key heads:
    HF's value head k r + v is the file's head v Hk + k, in every tensor with a value-head axis."""
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    if not config.hybrid or Hv == Hk or ".linear_attn." not in name:
        return None, None
    r, dv, qk = Hv // Hk, config.linear_value_head_dim, 2 * Hk * config.linear_key_head_dim
    head = np.arange(Hv) % r * Hk + np.arange(Hv) // r           # (Hv,) the file's place of HF's head k r + v

    def heads(d, before=0):   # (before + Hv*d,) the first `before` rows (q and k) in place, then d per value head
        return np.concatenate([np.arange(before), before + (head[:, None] * d + np.arange(d)).reshape(-1)])

    part = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    return {"in_proj_qkv": (heads(dv, qk), None), "conv1d": (heads(dv, qk), None), "in_proj_z": (heads(dv), None),
            "in_proj_a": (heads(1), None), "in_proj_b": (heads(1), None), "A_log": (heads(1), None),
            "dt_bias": (heads(1), None), "out_proj": (None, heads(dv))}.get(part, (None, None))


class ReorderedHeads(Compact):
    """A stored matrix whose rows and columns the file holds in another order, kept as stored:
    W[i, j] = stored[rows[i], columns[j]] (value_head_order). x @ W^T gathers x's columns into the file's order
    and the outputs back into HF's: two gathers of (T, n) activations, none of the weights."""

    def __init__(self, stored, rows=None, columns=None):
        self.stored, self.row_order, self.column_order = stored, rows, columns
        self.shape, self.format = stored.shape, stored.format
        self.column_gather = None if columns is None else np.argsort(columns)   # x's column at each file column
        self.row_gather = None if rows is None else np.argsort(rows)            # d_y's column at each file row

    @property
    def storage(self):
        return self.stored.storage

    @property
    def arrays(self):
        return self.stored.arrays

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes

    def linear(self, x):
        """x @ W^T: (T, in) -> (T, out)."""
        xp = xp_of(x)
        if self.column_gather is not None:
            x = x[:, xp.asarray(self.column_gather)]                   # (T, in) in the file's column order
        y = self.stored.linear(x)                                       # (T, out) in the file's row order
        return y if self.row_order is None else y[:, xp.asarray(self.row_order)]

    def linear_backward(self, d_y):
        """d_x = d_y @ W: (T, out) -> (T, in), through the stored matrix as linear goes, the gathers the other way
        round: d_y's columns into the file's row order, the stored weight's d_y @ W, its columns back in HF's."""
        xp = xp_of(d_y)
        if self.row_order is not None:
            d_y = d_y[:, xp.asarray(self.row_gather)]                    # (T, out) in the file's row order
        d_x = self.stored.linear_backward(d_y)                          # (T, in) in the file's column order
        return d_x if self.column_order is None else d_x[:, xp.asarray(self.column_order)]

    def take(self, ids):
        """Rows `ids` (T,) widened to float32 (T, in), in HF's order."""
        rows = self.stored.take(ids if self.row_order is None else self.row_order[to_numpy(ids)])
        return rows if self.column_order is None else rows[:, xp_of(rows).asarray(self.column_order)]

    def rows(self, sel):
        """HF's rows `sel` (a tensor-parallel rank's): gathered from the stored rows (a copy of their bytes)."""
        stored = self.stored.rows(sel if self.row_order is None else self.row_order[sel])
        return stored if self.column_order is None else ReorderedHeads(stored, None, self.column_order)

    def columns(self, sel):
        if self.column_order is not None:
            raise NpqwenError(f"a tensor-parallel rank cannot take columns of a {self.format} matrix whose value "
                              f"heads llama.cpp reordered (a qwen35 GGUF with more value heads than key heads): "
                              f"run it in one process, or convert the HF checkpoint with npqwen quantize")
        return ReorderedHeads(self.stored.columns(sel), self.row_order, None)


def in_hf_order(w, rows, columns):
    """A stored matrix (compact, or a float32 array) with HF's row and column order (value_head_order)."""
    if rows is None and columns is None:
        return w
    if isinstance(w, np.ndarray):   # F32: the array reordered (a copy, as float32 is widened anyway)
        return w[rows if rows is not None else slice(None)][:, columns if columns is not None else slice(None)]
    return ReorderedHeads(w, rows, columns)


def part_of(t: GGUFTensor, part, order=(None, None)):
    """A tensor-parallel rank's part (rows, columns) of a stored matrix in HF's order: rows stay mapped, columns
    are copied (on whole blocks; weights.check_block_columns says what to do otherwise)."""
    w = in_hf_order(stored_weight(t), *order)
    if part is None:
        return w
    rows, columns = part[0], part[1] if len(part) > 1 else slice(None)
    if isinstance(w, np.ndarray):
        return w[rows][:, columns]
    w = w.rows(rows)
    return w if columns == slice(None) else w.columns(columns)


def load_gguf_weights(config, tensors: dict[str, GGUFTensor], xp, dtype, path, weights: str = "auto",
                      parts: dict | None = None):
    """(weights, fused) as checkpoint.load_weights returns them, from a GGUF's tensors.

    `weights` as npqwen.load's: "auto" keeps a quantized file's matrices as stored (memory-mapped, widened a
    block of rows at a time) and widens an F32/F16/BF16 file to float32 where that fits; "stored"; "float32";
    or a format to convert to. Norms and the router are small and always float32. With `parts` (tensor
    parallelism: HF name -> (rows, columns), parallel.shards) each rank keeps only its part of each tensor."""
    from .backend import free_memory_bytes
    from .checkpoint import (allocate_weights, compact, expected_shapes, is_matrix, stack_compact, tie_lm_head,
                             widen_into)
    from .parallel import shard_shape
    from .weights import FORMATS

    tensors = hf_tensors(tensors)
    shapes = expected_shapes(config, lm_head=not config.tie_word_embeddings)
    joined = indexer_parts(config, shapes)   # qwen4exp: HF's index_qk_proj is the file's q_proj and k_proj
    for name, shape in [pair for n, s in shapes.items() for pair in joined.get(n, [(n, s)])]:
        if name not in tensors:
            raise NpqwenError(f"{path}: the GGUF has no tensor for {name} (expected shape {list(shape)})")
        if tensors[name].shape != shape:
            raise NpqwenError(f"{path}: tensor {tensors[name].name} has shape {list(tensors[name].shape)} where "
                              f"the GGUF's metadata says {list(shape)}; the file is inconsistent")
    choices = ("auto", "float32", "stored", *FORMATS)
    if weights not in choices:
        raise NpqwenError(f"unknown weights format {weights!r}; use one of {', '.join(choices)}")
    if weights == "auto":
        quantized = any(tensors[n].qtype not in ("F32", "F16", "BF16") for n in shapes if n in tensors)
        need = sum(int(np.prod(shape)) for shape in shapes.values()) * np.dtype(dtype).itemsize
        weights = "float32" if not quantized and need <= free_memory_bytes(xp) else "stored"
    if weights == "stored" and all(tensors[n].qtype == "F32" for n in shapes if is_matrix(n) and n in tensors):
        weights = "float32"   # an F32 file as stored is float32
    if weights != "float32" and np.dtype(dtype) != np.float32:
        raise NpqwenError(f"compact weights ({weights}) compute in float32; load the GGUF with dtype float32, or "
                          f"with weights='float32' to compute in {np.dtype(dtype).name}")
    full = shapes
    if parts is not None:
        shapes = {name: shard_shape(shape, parts[name]) for name, shape in shapes.items()}

    def part(name):   # this rank's (rows, columns) of `name`, or None for the whole tensor
        return None if parts is None or shapes[name] == full[name] else parts[name]

    def small(name):   # a norm or the router, widened whole, then this rank's part
        value = hf_value(config, name, tensors[name].dequantize())
        rows = value_head_order(config, name)[0]
        value = value if rows is None else value[rows]                  # a qwen35 GGUF's value heads in HF's order
        return xp.asarray(value if part(name) is None else value[part(name)[0]][..., part(name)[1]]
                          if value.ndim > 1 else value[part(name)[0]])

    if weights == "float32":   # every matrix widened into float32, a block of rows at a time
        arrays, fused = allocate_weights(config, xp, dtype, shapes)
        for name, array in arrays.items():
            host = array if xp is np else np.empty(array.shape, np.float32)
            if array.ndim == 1 or not is_matrix(name) and part(name) is None:   # (a conv1d, a mix: maybe F16)
                host[...] = small(name)
            elif name in joined:   # the indexer's q rows, then its k rows
                q, k = (n for n, _ in joined[name])
                widen_into(part_of(tensors[q], None), host[:tensors[q].shape[0]])
                widen_into(part_of(tensors[k], None), host[tensors[q].shape[0]:])
            else:
                widen_into(part_of(tensors[name], part(name), value_head_order(config, name)), host)
            if xp is not np:
                array[...] = xp.asarray(host)
        return {**tie_lm_head(config, arrays), **ple_tables(config, tensors, path)}, fused

    def matrix(name):   # this rank's part in `weights`' format, in HF's order
        if name in joined:   # the indexer's q and k stacked by rows (llama.cpp keeps both F32)
            q, k = (compact(part_of(tensors[n], None), weights, xp) for n, _ in joined[name])
            return Rows([q, k]) if is_compact(q) and is_compact(k) else xp.concatenate([as_array(q), as_array(k)])
        w = part_of(tensors[name], part(name), value_head_order(config, name))
        if isinstance(w, ReorderedHeads):   # the stored matrix converted (row by row), its order kept
            return ReorderedHeads(compact(w.stored, weights, xp), w.row_order, w.column_order)
        return compact(w, weights, xp)

    arrays = {name: matrix(name) if is_matrix(name) else small(name) for name in shapes}
    return {**tie_lm_head(config, arrays), **ple_tables(config, tensors, path)}, stack_compact(config, arrays)


def indexer_parts(config, shapes: dict) -> dict:
    """qwen4exp's QSA indexer: HF's index_qk_proj ((Hi + 1) di, D) is llama.cpp's indexer.q_proj (Hi di rows) and
    indexer.k_proj (di rows), which its converter split. HF name -> [(q name, shape), (k name, shape)]."""
    if not config.qwen4_exp:
        return {}
    Hi, di, D = config.indexer_n_heads, config.indexer_head_dim, config.hidden_size
    return {name: [(name.replace("index_qk_proj", "q_proj"), (Hi * di, D)),
                   (name.replace("index_qk_proj", "k_proj"), (di, D))]
            for name in shapes if name.endswith(".indexer.index_qk_proj.weight")}


class TableRows:
    """A PLE table the file keeps in a compact format (a Q8_0 GGUF's per_layer_token_embd is Q8_0): indexing widens
    only the rows looked up, so ple.NgramTable reads it as it reads a memory-mapped float table."""

    def __init__(self, w):
        self.w, self.shape, self.nbytes = w, w.shape, w.nbytes

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, ids):
        return self.w.take(np.asarray(ids))                                    # (n, d) float32


def ple_tables(config, tensors: dict, path) -> dict:
    """qwen4exp's PLE table (per_layer_token_embd) as an NgramTable over the file's bytes, in its stored format."""
    from .checkpoint import ple_table_shapes
    from .ple import NgramTable

    tables = {}
    for name, shape in (ple_table_shapes(config) if config.qwen4_exp else {}).items():
        if name not in tensors or tensors[name].shape != shape:
            got = f"shape {list(tensors[name].shape)}" if name in tensors else "none"
            raise NpqwenError(f"{path}: the PLE table per_layer_token_embd.weight should have shape {list(shape)} "
                              f"(the ple.head_vocab_sizes' rows, padded), got {got}; the file is inconsistent")
        w = stored_weight(tensors[name])
        tables[name] = NgramTable([w if isinstance(w, np.ndarray) else TableRows(w)])
    return tables
