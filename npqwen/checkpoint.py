"""Read a Hugging Face Qwen3 checkpoint directory without torch: config.json + safetensors.

A .safetensors file is an 8-byte little-endian header length N, N bytes of JSON that give
each tensor's dtype, shape and byte range, then the raw tensor bytes. We read it with
np.memmap rather than the `safetensors` package because its NumPy loader has no bfloat16
(NumPy has no such dtype) and Qwen3 checkpoints are bfloat16: bf16 is just the top 16 bits
of a float32, so widening it is one shift (`bf16_bits_to_float32`).

Weights keep their HF names and shapes. A checkpoint saved from transformers' `Qwen3Model` (as
Qwen3-Embedding is) spells them without the `model.` prefix and has no `lm_head`; the loader
reads it under the prefixed names the model code uses (`canonical_names`), and `npqwen.load`
shows them to the user as the checkpoint spells them (`stored_names`). For speed, each layer's q/k/v projections are
stacked into one `qkv_proj` matrix and gate/up into one `gate_up_proj` matrix; the
HF-named entries are row-slices (views) of those, so writing to one changes the other.
A Qwen3-MoE checkpoint holds each expert apart, as the hub and transformers' save_pretrained
write it (`model.layers.N.mlp.experts.E.gate_proj.weight`, ...); in memory a layer's experts
are two arrays, `mlp.experts.gate_up_proj` (E, 2I, D) and `mlp.experts.down_proj` (E, D, I),
transformers' own in-memory layout, and each expert's HF-named entries are views into them.
"""
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backend import free_memory_bytes, xp_of
from .config import Qwen3Config
from .errors import NpqwenError
from .parallel import shard_shape
from .weights import (FP8, THREADS, BFloat16, Float16, Ggml, Int8, Rows, as_array, bf16_bits_to_float32,
                      float32_to_bf16_bits, is_compact, join_rows, kept_format, matrix_bytes, quantize,
                      with_arrays)

# safetensors dtype -> (NumPy dtype of the stored bits, bytes per element): the ones npqwen reads
STORED_DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4)}
# bytes per element of every byte-sized dtype the safetensors format defines (to check byte ranges)
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
                        "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                        "F64": 8, "C64": 8}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # as the safetensors specification
CHUNK_BYTES = 32 * 1024 * 1024        # convert this much at a time to keep peak memory low
MAX_NAMES_IN_WARNING = 10             # unused tensor names listed before "... and N more"
# a compact matrix's scales beside it: Qwen's FP8 (per 128x128 block), npqwen's int8 (per row)
SCALE_SUFFIXES = {"F8_E4M3": "weight_scale_inv", "I8": "weight_scale"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, stored dtype, shape and absolute byte range."""
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    qtype: str | None = None   # a U8 tensor's ggml block type (Q4_K, ...), from the file's __metadata__


def short(value, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters, so a hostile header cannot flood an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_count(value) -> bool:
    """A non-negative JSON integer (bools are ints in Python, but not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def refuse_duplicate_names(pairs: list) -> dict:
    """json object_pairs_hook: a name given twice would silently keep the last entry."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the name {short(key)} appears twice")
        seen[key] = value
    return seen


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check a .safetensors header as the format defines it.

    Layout: 8-byte little-endian N, N bytes of JSON, then the data section. Every entry but
    "__metadata__" (a str -> str object) is {"dtype", "shape", "data_offsets": [begin, end]},
    offsets relative to the data section; sorted by begin, the ranges must tile it exactly.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > MAX_HEADER_BYTES or 8 + n > size:   # refused before reading N bytes
            raise NpqwenError(f"{path}: not a safetensors file or truncated (file is {size} bytes, header says "
                              f"{n} header bytes); download it again")
        try:
            header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=refuse_duplicate_names)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:   # JSONDecodeError is a ValueError
            raise NpqwenError(f"{path}: corrupt safetensors header ({short(str(e), 200)}); download the file "
                              f"again") from None
    if not isinstance(header, dict):
        raise NpqwenError(f"{path}: corrupt safetensors header (not a JSON object); download the file again")
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise NpqwenError(f"{path}: corrupt safetensors header: __metadata__ must map strings to strings, got "
                          f"{short(metadata)}; download the file again")
    data_start, data_bytes = 8 + n, size - 8 - n
    tensors = {}
    for name, entry in header.items():
        dtype, shape, begin, end = check_header_entry(path, name, entry, data_bytes)
        qtype = metadata.get(name) if dtype == "U8" else None   # npqwen quantize's ggml rows: their block type
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, data_start + end, qtype)
    check_byte_ranges(path, tensors, data_start, size)
    return tensors


def check_header_entry(path: Path, name: str, entry, data_bytes: int) -> tuple[str, tuple, int, int]:
    """(dtype, shape, begin, end) of one header entry, or NpqwenError saying what is wrong with it."""
    def corrupt(what):
        return NpqwenError(f"{path}: corrupt safetensors header: tensor {short(name)} {what}; download the "
                           f"file again")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise corrupt(f"needs dtype, shape and data_offsets, got {short(entry)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
        raise corrupt(f"has an unknown dtype {short(dtype)}")
    if not (isinstance(shape, list) and all(is_count(d) for d in shape)):
        raise corrupt(f"has shape {short(shape)}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_count(o) for o in offsets)):
        raise corrupt(f"has data_offsets {short(offsets)}, not [begin, end] non-negative integers")
    begin, end = offsets
    if end > data_bytes:
        raise NpqwenError(f"{path} is truncated: tensor {short(name)} ends at byte {short(end)} of a "
                          f"{data_bytes}-byte data section; download it again")
    # The element count, stopped early once it cannot fit: a hostile shape of huge numbers
    # would otherwise make a product with millions of digits.
    count = 0 if 0 in shape else 1
    for d in shape if count else ():
        count *= d
        if count > data_bytes:
            break
    nbytes = count * SAFETENSORS_ITEMSIZE[dtype]
    if count > data_bytes:
        raise corrupt(f"of shape {short(shape)} needs more bytes than the file's {data_bytes}-byte data section")
    if end < begin or end - begin != nbytes:
        raise corrupt(f"of shape {short(shape)} {dtype} needs {nbytes} bytes but its data_offsets "
                      f"{short(offsets)} hold {end - begin}")
    return dtype, tuple(shape), begin, end


def check_byte_ranges(path: Path, tensors: dict[str, TensorInfo], data_start: int, size: int):
    """Sorted by start, the tensors' byte ranges must tile the data section: no overlap, no gap, no tail."""
    at, gap = data_start, None
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if t.start < at:
            raise NpqwenError(f"{path}: corrupt safetensors header: tensor {short(t.name)} at bytes "
                              f"{t.start}..{t.end} overlaps the tensor before it; download the file again")
        if t.start > at and gap is None:
            gap = f"a gap of {t.start - at} bytes before tensor {short(t.name)} (at byte {t.start})"
        at = t.end
    if gap is not None:   # reported after overlaps: two tensors on one range also leave a hole elsewhere
        raise NpqwenError(f"{path}: corrupt safetensors header: {gap}; download the file again")
    if at != size:
        raise NpqwenError(f"{path}: {size - at} bytes after the last tensor are not described by the header "
                          f"(file is {size} bytes, tensors end at {at}); the file is corrupt, download it again")


def index_checkpoint(directory: Path) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint: one model.safetensors, or shards named by model.safetensors.index.json."""
    directory = Path(directory)
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise NpqwenError(f"{index_file}: not a valid safetensors index (needs a 'weight_map'): {e}") from e
    elif (directory / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise NpqwenError(f"{directory}: no model.safetensors or model.safetensors.index.json; is this a "
                          f"Hugging Face Qwen3 checkpoint directory?")
    tensors = {}
    for name in files:
        if not isinstance(name, str) or not (directory / name).is_file():
            raise NpqwenError(f"{directory}: shard {name if isinstance(name, str) else short(name)} named in "
                              f"model.safetensors.index.json is missing; download it again")
        for key, info in read_safetensors_header(directory / name).items():
            if key in tensors:
                raise NpqwenError(f"{directory}: tensor {short(key)} is in both {tensors[key].file.name} and "
                                  f"{name}; the checkpoint is corrupt, download it again")
            tensors[key] = info
    if weight_map is not None:
        for key, file in weight_map.items():
            if key not in tensors or tensors[key].file.name != file:
                raise NpqwenError(f"{directory / file}: tensor {short(key)} listed in the index is not in the "
                                  f"file; download the checkpoint again")
    return tensors


def canonical_names(found: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The tensors under Qwen3ForCausalLM's names: a checkpoint saved from Qwen3Model ("embed_tokens.weight",
    "layers.0...", "norm.weight") gets the "model." prefix; each TensorInfo keeps the name as stored."""
    if "model.language_model.embed_tokens.weight" in found:   # Qwen3.5's hub layout: the text model only
        return {name.replace("model.language_model.", "model.", 1): info for name, info in found.items()
                if name.startswith(("model.language_model.", "lm_head."))}   # model.visual.*, mtp.*: left unread
    if "model.embed_tokens.weight" in found or "embed_tokens.weight" not in found:
        return found
    return {(name if name.startswith("lm_head.") else f"model.{name}"): info for name, info in found.items()}


def stored_names(directory) -> dict[str, str]:
    """The prefixed name of each tensor (as the model code reads it) -> its name in the checkpoint's files."""
    return {name: info.name for name, info in canonical_names(index_checkpoint(directory)).items()}


def has_lm_head(config: Qwen3Config, found: dict[str, TensorInfo]) -> bool:
    """Whether the checkpoint can compute logits: a tied or stored lm_head. Only a Qwen3Model checkpoint
    (names without "model.", e.g. Qwen3-Embedding-8B) may lack an untied one; it can embed but not generate."""
    bare = not any(info.name.startswith("model.") for info in found.values())
    return config.tie_word_embeddings or "lm_head.weight" in found or not bare


def check_config_matches(config: Qwen3Config, found: dict[str, TensorInfo], source) -> None:
    """Compare config.json's sizes with the stored tensors before anything is sized from them.

    A wrong size (a typo, or the config of another model) would otherwise surface later as a
    shape error on one tensor, or, for an absurd num_hidden_layers, as a table of a billion
    expected names that never finishes building.
    """
    def stored(name):
        info = found.get(name)
        if info is None:
            return None
        check_dtype(found, name, directory=source)
        return matrix_shape(info)

    def agree(key, value, name, axis, what):
        shape = stored(name)
        if shape is not None and len(shape) > axis and shape[axis] != value:
            raise NpqwenError(f"{source}: config.json says {key} is {value} but {name} has {what} "
                              f"{shape[axis]} (shape {list(shape)}); the config does not match the weights, "
                              f"fix {key} or use the config.json that came with them")

    layers = {int(n.split(".")[2]) for n in found
              if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if config.num_hidden_layers > len(layers):
        have = f"{len(layers)} layers" + (f" (model.layers.{min(layers)} .. model.layers.{max(layers)})"
                                          if layers else "")
        raise NpqwenError(f"{source}: config.json says num_hidden_layers is {config.num_hidden_layers} but the "
                          f"checkpoint holds {have}; fix num_hidden_layers or download the missing shards")
    check_experts_match(config, found, source)
    Dh = config.head_dim
    agree("vocab_size", config.vocab_size, "model.embed_tokens.weight", 0, "rows")
    agree("hidden_size", config.hidden_size, "model.embed_tokens.weight", 1, "columns")
    first = next((i for i in range(config.num_hidden_layers) if not config.is_linear_layer(i)), 0)   # full attention
    gate = 2 if config.hybrid else 1   # Qwen3.5's q_proj also yields the output gate
    agree("head_dim", Dh, f"model.layers.{first}.self_attn.q_norm.weight", 0, "size")
    for key, heads, name in (("num_attention_heads", gate * config.num_attention_heads, "q_proj"),
                             ("num_key_value_heads", config.num_key_value_heads, "k_proj")):
        shape = stored(f"model.layers.{first}.self_attn.{name}.weight")
        if shape and shape[0] != heads * Dh:
            raise NpqwenError(f"{source}: config.json says {key} is {heads // (gate if name == 'q_proj' else 1)} "
                              f"but model.layers.{first}.self_attn.{name}.weight has {shape[0]} rows, "
                              f"{shape[0] / Dh:g} heads of head_dim {Dh}; the config does not match the weights, "
                              f"fix {key}")
    dense = next((i for i in range(config.num_hidden_layers) if not config.is_moe_layer(i)), None)
    if dense is not None:
        agree("intermediate_size", config.intermediate_size, f"model.layers.{dense}.mlp.gate_proj.weight", 0, "rows")
    sparse = next((i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)), None)
    if sparse is not None:
        agree("num_experts", config.num_experts, f"model.layers.{sparse}.mlp.gate.weight", 0, "rows")
        agree("moe_intermediate_size", config.moe_intermediate_size,
              f"model.layers.{sparse}.mlp.experts.0.gate_proj.weight", 0, "rows")
    if not config.tie_word_embeddings:
        agree("vocab_size", config.vocab_size, "lm_head.weight", 0, "rows")


def check_experts_match(config: Qwen3Config, found: dict[str, TensorInfo], source) -> None:
    """A Qwen3-MoE config against the experts stored, before the table of E x layers names is built."""
    fused = next((n for n in found if n.endswith(".mlp.experts.gate_up_proj")), None)
    if config.fused_experts:   # Qwen3-VL-MoE: two tensors per layer, read by read_fused_experts
        return
    if fused is not None:
        raise NpqwenError(f"{source}: the checkpoint stores its experts fused ({fused}), as transformers holds "
                          f"them in memory; npqwen reads the layout the hub and save_pretrained write, one "
                          f"tensor per expert (model.layers.N.mlp.experts.E.gate_proj.weight, ...)")
    experts = {n.split(".")[5] for n in found if n.startswith("model.layers.") and ".mlp.experts." in n}
    stored = sum(e.isdigit() for e in experts)
    if stored and not config.num_experts:
        raise NpqwenError(f"{source}: the checkpoint holds {stored} experts per layer (a Qwen3-MoE) but config.json "
                          f"describes a dense Qwen3 (model_type {config.model_type!r}); use the config.json that "
                          f"came with the weights (model_type 'qwen3_moe')")
    if config.num_experts > stored:
        have = "no experts: it is a dense checkpoint" if not stored else f"{stored} experts per layer"
        raise NpqwenError(f"{source}: config.json says num_experts is {config.num_experts} but the checkpoint "
                          f"holds {have}; fix num_experts or use the config.json that came with the weights")


def warn_unused(found: dict[str, TensorInfo], config: Qwen3Config, shapes: dict, directory) -> None:
    """As transformers does: tensors the config does not use are loaded past, with one warning."""
    scales = {n[:-len("weight")] + SCALE_SUFFIXES[found[n].dtype] for n in shapes
              if n in found and found[n].dtype in SCALE_SUFFIXES}   # read with their matrices
    unused = sorted(n for n in set(found) - set(shapes) - scales - {"lm_head.weight"}   # a tied lm_head is expected
                    if not (config.hybrid and n.startswith("mtp."))   # Qwen3.5's MTP head: read on demand (mtp.py)
                    and ".ple.ple_embedding." not in n)   # Qwen4-Exp's PLE tables (mapped) and hash constants
    if unused:
        listed = ", ".join(short(n, 100) for n in unused[:MAX_NAMES_IN_WARNING])
        more = f" ... and {len(unused) - MAX_NAMES_IN_WARNING} more" if len(unused) > MAX_NAMES_IN_WARNING else ""
        warnings.warn(f"{directory}: {len(unused)} tensors in the checkpoint are not used by this config.json "
                      f"(num_hidden_layers={config.num_hidden_layers}) and were not loaded: {listed}{more}",
                      stacklevel=3)


def expected_shapes(config: Qwen3Config, lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3 checkpoint must hold, by HF name, with its HF shape (out, in); an untied
    lm_head unless `lm_head` is False (a Qwen3Model checkpoint without one)."""
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    E, I = config.num_experts, config.moe_intermediate_size
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attention = (linear_attention_shapes(config, p) if config.is_linear_layer(i)   # Gated DeltaNet
                     else attention_shapes(config, p))
        if config.qwen4_exp:   # no norms of its own: the hyper-connections normalise each block's input
            shapes.update({**attention, **qwen4_layer_shapes(config, i)})
        else:
            shapes.update({f"{p}.input_layernorm.weight": (D,), **attention,
                           f"{p}.post_attention_layernorm.weight": (D,)})
        if config.is_moe_layer(i):   # the router, then E experts, each a SwiGLU of width I
            shapes[f"{p}.mlp.gate.weight"] = (E, D)
            for e in range(E):
                shapes.update({f"{p}.mlp.experts.{e}.gate_proj.weight": (I, D),
                               f"{p}.mlp.experts.{e}.up_proj.weight": (I, D),
                               f"{p}.mlp.experts.{e}.down_proj.weight": (D, I)})
            if config.shared_expert_intermediate_size:
                shapes.update(shared_expert_shapes(config, p))
        else:
            shapes.update({f"{p}.mlp.gate_proj.weight": (F, D), f"{p}.mlp.up_proj.weight": (F, D),
                           f"{p}.mlp.down_proj.weight": (D, F)})
    if config.qwen4_exp:   # the final mixing of the C streams into one takes the final norm's place
        shapes.update(hyper_connection_shapes(config, "model.hyper_connection_mixer", inject=False))
    else:
        shapes["model.norm.weight"] = (D,)
    if lm_head and not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def attention_shapes(config: Qwen3Config, p: str) -> dict[str, tuple[int, ...]]:
    """A full-attention layer's tensors; Qwen3.5's q_proj yields each head's query and its output gate."""
    D, H, K, Dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    gate, a = 2 if config.hybrid else 1, f"{p}.self_attn"
    shapes = {f"{a}.q_proj.weight": (gate * H * Dh, D), f"{a}.k_proj.weight": (K * Dh, D),
              f"{a}.v_proj.weight": (K * Dh, D)}
    if config.attention_bias:   # Qwen2: a bias on each of q, k, v (none on o_proj)
        shapes.update({f"{a}.q_proj.bias": (H * Dh,), f"{a}.k_proj.bias": (K * Dh,), f"{a}.v_proj.bias": (K * Dh,)})
    if config.qk_norm:          # Qwen3: one RMSNorm weight over a head's Dh values, for q and for k
        shapes.update({f"{a}.q_norm.weight": (Dh,), f"{a}.k_norm.weight": (Dh,)})
    return {**shapes, f"{a}.o_proj.weight": (D, H * Dh)}


def hyper_connection_shapes(config: Qwen3Config, p: str, inject: bool = True) -> dict[str, tuple[int, ...]]:
    """One of Qwen4-Exp's gated residuals (npqwen/hyper_connections.py): C streams of D, mixed at rank R."""
    CD, R = config.hc_count * config.hidden_size, config.hc_lowrank
    shapes = {f"{p}.hc_norm.weight": (CD,), f"{p}.input_mix_weight_down.weight": (R, CD),
              f"{p}.input_mix_weight_up.weight": (CD, R)}
    return {**shapes, f"{p}.block_inject_weight.weight": (config.hc_count, CD)} if inject else shapes


def qwen4_layer_shapes(config: Qwen3Config, i: int) -> dict[str, tuple[int, ...]]:
    """Qwen4-Exp's additions to layer i: the two gated residuals, QSA's indexer on an attention layer, and on a PLE
    layer its projections, norms and convolution (its n-gram table is memory-mapped: ple_table_shapes)."""
    p, D, CD = f"model.layers.{i}", config.hidden_size, config.hc_count * config.hidden_size
    shapes = {**hyper_connection_shapes(config, f"{p}.attn_hyper_connection"),
              **hyper_connection_shapes(config, f"{p}.mlp_hyper_connection")}
    if not config.is_linear_layer(i):   # QSA's indexer: Hi query heads and one key head of di, and their norms
        Hi, di = config.indexer_n_heads, config.indexer_head_dim
        shapes.update({f"{p}.self_attn.indexer.index_qk_proj.weight": ((Hi + 1) * di, D),
                       f"{p}.self_attn.indexer.q_layernorm.weight": (di,),
                       f"{p}.self_attn.indexer.k_layernorm.weight": (di,)})
    if config.is_ple_layer(i):
        E, q = config.ple_embed_dim, f"{p}.ple"
        shapes.update({f"{q}.key_proj.weight": (CD, E), f"{q}.value_proj.weight": (D, E),
                       f"{q}.norm_key.weight": (CD,), f"{q}.norm_query.weight": (CD,), f"{q}.norm_conv.weight": (CD,),
                       f"{q}.conv1d.weight": (CD, 1, config.ple_conv_kernel_size)})
    return shapes


def ple_table_shapes(config: Qwen3Config) -> dict[str, tuple[int, int]]:
    """Each PLE layer's n-gram table (rows, d): its Hn hash heads' prime-sized tables one after another, padded to a
    multiple of make_ngram_vocab_size_divisible_by rows; d = ple_embed_dim / Hn. 51B parameters in the real model."""
    from .ple import table_rows

    Hn = (config.ngram_size - 1) * config.heads_per_ngram
    return {f"model.layers.{i}.ple.ple_embedding.ngram_embedding.weight":
            (table_rows(config, config.ple_index(i)), config.ple_embed_dim // Hn)
            for i in range(config.num_hidden_layers) if config.is_ple_layer(i)}


def shared_expert_shapes(config: Qwen3Config, p: str) -> dict[str, tuple[int, ...]]:
    """Qwen3.5-MoE's shared expert, a SwiGLU every token runs, and its sigmoid gate."""
    D, S = config.hidden_size, config.shared_expert_intermediate_size
    return {f"{p}.mlp.shared_expert.gate_proj.weight": (S, D), f"{p}.mlp.shared_expert.up_proj.weight": (S, D),
            f"{p}.mlp.shared_expert.down_proj.weight": (D, S), f"{p}.mlp.shared_expert_gate.weight": (1, D)}


def linear_attention_shapes(config: Qwen3Config, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (HF's Qwen3_5GatedDeltaNet): Hk key heads of dk, Hv value heads of dv."""
    D, W = config.hidden_size, config.linear_conv_kernel_dim
    Hk, dk, Hv, dv = (config.linear_num_key_heads, config.linear_key_head_dim, config.linear_num_value_heads,
                      config.linear_value_head_dim)
    C = 2 * Hk * dk + Hv * dv   # q, k and v, convolved together
    p = f"{p}.linear_attn"
    if config.qwen3_next:   # q, k, v, z and b, a in two matrices, their rows grouped by key head
        inputs = {f"{p}.in_proj_qkvz.weight": (C + Hv * dv, D), f"{p}.in_proj_ba.weight": (2 * Hv, D)}
    else:
        inputs = {f"{p}.in_proj_qkv.weight": (C, D), f"{p}.in_proj_z.weight": (Hv * dv, D),
                  f"{p}.in_proj_b.weight": (Hv, D), f"{p}.in_proj_a.weight": (Hv, D)}
    return {f"{p}.dt_bias": (Hv,), f"{p}.A_log": (Hv,), f"{p}.conv1d.weight": (C, 1, W),
            f"{p}.norm.weight": (dv,), f"{p}.out_proj.weight": (D, Hv * dv), **inputs}


def parameter_counts(config: Qwen3Config) -> tuple[int, int]:
    """(total, active per token) parameters; a tied lm_head is counted once. A token runs k of the
    E experts of a sparse layer, so the other E - k experts' weights are not active for it."""
    total = sum(math.prod(shape) for shape in expected_shapes(config).values())
    sparse = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    expert = 3 * config.moe_intermediate_size * config.hidden_size   # gate_proj, up_proj, down_proj
    return total, total - sparse * (config.num_experts - config.num_experts_per_tok) * expert


def read_tensor(info: TensorInfo, out):
    """Copy one tensor from its file into the contiguous array `out`, converting to out's dtype.

    The file is memory-mapped a chunk at a time and each map is closed after use, so the
    mapped bf16 pages never pile up on top of the converted weights.
    """
    xp = xp_of(out)
    stored, itemsize = STORED_DTYPES[info.dtype]
    flat = out.reshape(-1)
    step = CHUNK_BYTES // itemsize
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        chunk = np.memmap(info.file, dtype=stored, mode="r", offset=info.start + i * itemsize, shape=(n,))
        if info.dtype == "BF16":
            bf16_bits_to_float32(xp.asarray(chunk), flat[i:i + n])
        else:
            flat[i:i + n] = xp.asarray(chunk)
        del chunk
    check_finite(info, out)


def read_tensor_part(info: TensorInfo, out, rows, *rest):
    """Copy some rows of a tensor, and of each row the part `rest` says (a slice per further axis), into `out`
    (tensor parallelism: a rank's part of it). `rows`: a slice, or an index array (several runs of rows,
    as a Gated DeltaNet rank's q, k and v rows of in_proj_qkv), each run read in turn.

    Only the bytes of those rows are mapped, a chunk of whole rows at a time, and of each row only
    its part is copied: a rank never holds the whole tensor, not even mapped."""
    done = 0
    for run in row_runs(rows, info.shape[0]):
        read_rows(info, out[done:done + len(run)], run, rest)
        done += len(run)
    check_finite(info, out)


def row_runs(rows, n: int) -> list[range]:
    """A slice of range(n), or an index array, as runs of consecutive rows."""
    if not isinstance(rows, np.ndarray):
        return [range(*rows.indices(n))]
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return [range(int(run[0]), int(run[-1]) + 1) for run in np.split(rows, breaks) if len(run)]


def read_rows(info: TensorInfo, out, rows: range, rest: tuple):
    """Rows rows.start .. rows.stop - 1 of a tensor, each cut by `rest`, into `out`."""
    xp = xp_of(out)
    stored, itemsize = STORED_DTYPES[info.dtype]
    width = math.prod(info.shape[1:])                                                  # values per row
    step = max(1, CHUNK_BYTES // (width * itemsize))                                   # rows per chunk
    for i in range(0, len(rows), step):
        n = min(step, len(rows) - i)
        chunk = np.memmap(info.file, dtype=stored, mode="r", offset=info.start + (rows.start + i) * width * itemsize,
                          shape=(n, *info.shape[1:]))                                  # (n, in): whole rows
        part = chunk[(slice(None), *rest)]                                             # (n, its columns)
        if info.dtype == "BF16":
            bf16_bits_to_float32(xp.asarray(part), out[i:i + n])
        else:
            out[i:i + n] = xp.asarray(part)
        del chunk, part


def check_finite(info: TensorInfo, out):
    xp = xp_of(out)
    if not bool(xp.isfinite(out).all()):
        raise NpqwenError(f"{info.file}: tensor {info.name!r} holds NaN or infinite values; the file is "
                          f"corrupt, download it again")


def load_weights(directory: Path, config: Qwen3Config, xp, dtype, parts: dict | None = None,
                 weights: str = "float32") -> tuple[dict, dict]:
    """Read every expected tensor into arrays of `dtype` on `xp`'s device, or with `weights` other than
    "float32" the matrices as compact weights (npqwen/weights.py): "stored" keeps each as the file holds it
    (bfloat16 memory-mapped, FP8, int8, ggml blocks), a format name ("int8", "q4_k", ...) converts it a few
    rows at a time; "auto" is float32 where it fits the free memory and the file holds no quantized matrix.

    Returns (weights, fused): `weights` maps each HF name to an array of its HF shape;
    `fused` holds the stacked per-layer matrices `...self_attn.qkv_proj.weight` and
    `...mlp.gate_up_proj.weight` that the HF q/k/v and gate/up entries are views of.
    With `parts` (tensor parallelism: HF name -> (rows, columns), see parallel.shards) each
    array holds only that part of its tensor, and only that part is read.
    """
    found = canonical_names(index_checkpoint(directory))
    check_config_matches(config, found, directory)   # before any table is sized from the config
    lm_head = has_lm_head(config, found)
    shapes = expected_shapes(config, lm_head)
    stacked = fused_expert_tensors(config, found, directory, parts)   # Qwen3-VL-MoE's two tensors per layer
    for name, shape in shapes.items():
        if name in stacked.get(name.split(".experts.")[0] + ".experts", {}).get("names", ()):
            continue   # an expert's projection, read from its layer's two tensors below
        if name not in found:
            raise NpqwenError(f"{directory}: tensor {name!r} is missing (expected shape {list(shape)}); "
                              f"the checkpoint does not match its config.json{family_hint(config, name)}")
        check_dtype(found, name, directory)
        if matrix_shape(found[name]) != shape:
            raise NpqwenError(f"{directory}: tensor {name!r} has shape {list(matrix_shape(found[name]))}, expected "
                              f"{list(shape)} from config.json; the checkpoint does not match its config.json")
    read = {f"{p}.{part}": () for p in stacked for part in ("gate_up_proj", "down_proj")}   # (Qwen3-VL-MoE)
    warn_unused(found, config, {**shapes, **read}, directory)
    if parts is not None:
        shapes = {name: shard_shape(shape, parts[name]) for name, shape in shapes.items()}
    weights = weights_format(weights, found, shapes, xp, dtype)
    if weights != "float32":
        arrays, fused = load_compact(found, config, xp, dtype, parts, shapes, weights, directory, stacked)
        return ({**arrays, **ple_tables(found, config, directory)} if config.qwen4_exp else arrays), fused
    check_fits(shapes, xp, dtype, directory)
    arrays, fused = allocate_weights(config, xp, dtype, shapes)
    for p, layer in stacked.items():   # (E, D, 2I) -> fused (E, 2I, D); (E, I, D) -> (E, D, I): one expert at a time
        read_fused_experts(layer["stored"], fused[f"{p}.gate_up_proj"], fused[f"{p}.down_proj"])
    for name, array in arrays.items():
        if any(name in layer["names"] for layer in stacked.values()):
            continue
        if found[name].dtype not in STORED_DTYPES:   # a quantized file read into float32: widened a block at a time
            widen_into(stored_weight(found, name, None if parts is None else parts[name]), array)
        elif parts is None or array.shape == found[name].shape:
            read_tensor(found[name], array)
        else:
            read_tensor_part(found[name], array, *parts[name])
    if config.qwen4_exp:   # the PLE tables stay on disk, memory-mapped (51B parameters in the real model)
        arrays.update(ple_tables(found, config, directory))
    return tie_lm_head(config, arrays), fused


def ple_tables(found: dict, config: Qwen3Config, directory) -> dict:
    """Each PLE layer's n-gram table as an NgramTable over the file's bytes (npqwen/ple.py): one tensor
    (ngram_embedding.weight) or the shards transformers writes (ngram_embedding.shard_0.weight, ..., one run of rows
    each, joined in order), checked against the rows and width the config gives."""
    from .ple import NgramTable

    tables = {}
    for name, (rows, d) in ple_table_shapes(config).items():
        base = name[:-len("weight")]
        infos = [found[name]] if name in found else sorted(
            (info for n, info in found.items() if n.startswith(f"{base}shard_") and n.endswith(".weight")),
            key=lambda info: int(info.name.split("shard_")[1].split(".")[0]))
        if not infos:
            raise NpqwenError(f"{directory}: tensor {name!r} (or its shards {base}shard_N.weight) is missing "
                              f"(expected shape {[rows, d]}); the checkpoint does not match its config.json")
        for info in infos:
            if info.dtype not in STORED_DTYPES or len(info.shape) != 2 or info.shape[1] != d:
                raise NpqwenError(f"{directory}: tensor {info.name!r} has shape {list(info.shape)} {info.dtype}; a "
                                  f"PLE table's rows are {d} wide (ple_embed_dim / hash heads), in BF16, F16 or F32")
        if sum(info.shape[0] for info in infos) != rows:
            raise NpqwenError(f"{directory}: {name!r} holds {sum(i.shape[0] for i in infos)} rows in "
                              f"{len(infos)} part(s), expected {rows} from config.json (the hash heads' primes)")
        widen = None
        if infos[0].dtype == "BF16":
            def widen(bits):
                out = np.empty(bits.shape, dtype=np.float32)
                bf16_bits_to_float32(bits, out)
                return out
        tables[name] = NgramTable([mapped(info, STORED_DTYPES[info.dtype][0]) for info in infos], widen)
    return tables


# Qwen4-Exp's hyper-connection projections (npqwen/hyper_connections.py): the low-rank mix's down (R, C*D) and up
# (C*D, R) and the injection weights' (C, C*D), linear maps like the others (0.43B parameters in the real model)
HYPER_CONNECTION_MATRICES = ("input_mix_weight_down.weight", "input_mix_weight_up.weight", "block_inject_weight.weight")


def is_matrix(name: str) -> bool:
    """The weights kept compact: every linear layer's (Gated DeltaNet's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    and Qwen3-Next's fused in_proj_qkvz, in_proj_ba included; Qwen4-Exp's hyper-connection projections), the
    embedding, lm_head. Norms, the router, a shared expert's gate and the convolution stay float32, as llama.cpp keeps
    them (they are small and read whole)."""
    return name.endswith(("_proj.weight", *HYPER_CONNECTION_MATRICES)) or \
        ".in_proj_" in name and name.endswith(".weight") or name in ("model.embed_tokens.weight", "lm_head.weight")


def check_dtype(found: dict, name: str, directory) -> None:
    """A tensor npqwen can read: BF16, F16 or F32; a matrix also FP8 with its block scales, int8 with its row
    scales, or ggml blocks (U8 with their type in the file's metadata: what `npqwen quantize` writes)."""
    info = found[name]
    if info.dtype in STORED_DTYPES:
        return
    where = f"{info.file}: tensor {short(name)} has dtype {info.dtype}"
    if not is_matrix(name) or info.dtype not in (*SCALE_SUFFIXES, "U8"):
        raise NpqwenError(f"{where}; npqwen reads BF16, F16 and F32 tensors, and for linear layers also FP8 "
                          f"(F8_E4M3 with weight_scale_inv), int8 (I8 with weight_scale) and the ggml blocks "
                          f"`npqwen quantize` writes")
    if info.dtype == "U8":
        from .quants import BLOCKS
        if info.qtype not in BLOCKS:
            raise NpqwenError(f"{where} but the file's metadata names no ggml block type for it (it says "
                              f"{short(info.qtype)}; npqwen reads {', '.join(BLOCKS)}); write it with npqwen quantize")
        return
    scale = name[:-len("weight")] + SCALE_SUFFIXES[info.dtype]
    if scale not in found:
        raise NpqwenError(f"{where} but the checkpoint has no {scale} for it (its scales); the checkpoint is "
                          f"incomplete, download it again")


def matrix_shape(info: TensorInfo) -> tuple[int, ...]:
    """The HF shape of a stored tensor: ggml rows (out, bytes per row) hold (out, in) values."""
    if info.dtype != "U8" or info.qtype is None:
        return info.shape
    from .quants import BLOCKS
    block, size = BLOCKS.get(info.qtype, (1, 1))
    return (info.shape[0], info.shape[1] // size * block)


def mapped(info: TensorInfo, dtype, shape=None) -> np.ndarray:
    """A tensor's bytes in the file, memory-mapped (read-only): nothing is read until it is used, and the map
    goes when the last array that views it does."""
    raw = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.start, shape=(info.end - info.start,))
    return raw.view(dtype).reshape(shape or info.shape)


def stored_weight(found: dict, name: str, part=None):
    """A matrix as the file stores it, memory-mapped: a compact weight, or a float32 array for F32. With
    `part` (rows, columns; tensor parallelism) only those: rows stay mapped, columns are copied."""
    info = found[name]
    scale = found.get(name[:-len("weight")] + SCALE_SUFFIXES.get(info.dtype, ""))
    if info.dtype == "BF16":
        w = BFloat16(mapped(info, np.uint16))
    elif info.dtype == "F16":
        w = Float16(mapped(info, np.float16))
    elif info.dtype == "F8_E4M3":
        w = FP8.from_blocks(mapped(info, np.uint8), read_small(scale))
    elif info.dtype == "I8":
        w = Int8(mapped(info, np.int8), read_small(scale).reshape(-1))
    elif info.dtype == "U8":
        w = Ggml(info.qtype, mapped(info, np.uint8), matrix_shape(info)[1])
    else:
        w = mapped(info, np.float32)
    if part is None:
        return w
    if isinstance(w, np.ndarray):   # (an F32 matrix)
        return w[part[0]][:, part[1] if len(part) > 1 else slice(None)]
    return rank_part(w, part)


def rank_part(w, part):
    """A rank's part (parallel.shards' rows, columns) of a whole tensor: a compact matrix's rows, then its columns
    on whole blocks; an array's by indexing."""
    if not is_compact(w):
        return w[part]
    w = w.rows(part[0])
    return w if len(part) < 2 or part[1] == slice(None) else w.columns(part[1])


def read_small(info: TensorInfo) -> np.ndarray:
    """A small tensor (scales) in float32, checked finite."""
    out = np.empty(info.shape, dtype=np.float32)
    read_tensor(info, out)
    return out


def widen_into(w, out):
    """A stored matrix into float32 `out`, a block of rows at a time, checked finite."""
    for a in range(0, out.shape[0], 4096):
        b = min(a + 4096, out.shape[0])
        out[a:b] = float32_rows(w, a, b)


def float32_rows(w, a: int, b: int) -> np.ndarray:
    """Rows a .. b-1 of a stored matrix in float32 (n, in) on the host, checked finite."""
    if isinstance(w, np.ndarray):
        rows = np.array(w[a:b], dtype=np.float32)
    else:
        rows = w.take(np.arange(a, b))
    if not np.isfinite(rows).all():
        raise NpqwenError(f"a weight holds NaN or infinite values in rows {a}..{b - 1}; the file is corrupt, "
                          f"download it again")
    return rows


def weights_format(weights: str, found: dict, shapes: dict, xp, dtype) -> str:
    """The format the matrices are kept in: "float32" (in `dtype`), "stored", or a format to convert to."""
    from .weights import FORMATS
    choices = ("auto", "float32", "stored", *FORMATS)
    if weights not in choices:
        raise NpqwenError(f"unknown weights format {weights!r}; use one of {', '.join(choices)}")
    quantized = any(found[n].dtype not in STORED_DTYPES for n in shapes if n in found)   # (not Qwen3-VL's experts)
    if weights == "auto":   # float32 unless it cannot fit (then check_fits says so for another compute dtype)
        need = sum(math.prod(shape) for shape in shapes.values()) * np.dtype(dtype).itemsize
        fits = need <= free_memory_bytes(xp) or np.dtype(dtype) != np.float32
        weights = "float32" if not quantized and fits else "stored"
    if weights != "float32" and np.dtype(dtype) != np.float32:
        raise NpqwenError(f"compact weights ({weights}) compute in float32; load them with dtype float32, or "
                          f"with weights='float32' to compute in {np.dtype(dtype).name}")
    return weights


def load_compact(found: dict, config: Qwen3Config, xp, dtype, parts, shapes: dict, fmt: str, directory,
                 stacked: dict | None = None):
    """The matrices as compact weights in `fmt` ("stored": as the file holds them), the rest in float32;
    q/k/v and gate/up stacked as Rows of their parts, a sparse layer's experts as lists. `stacked`: Qwen3-VL-MoE's
    two expert tensors per layer (fused_expert_tensors), each expert's slab converted on its own."""
    check_fits_compact(found, shapes, fmt, xp, directory)
    weights = {}
    for p, layer in (stacked or {}).items():
        weights.update(compact_experts(p, layer["stored"], fmt, xp, config.moe_intermediate_size, config.hidden_size))
    for name, shape in shapes.items():
        if name in weights:
            continue
        part = None if parts is None or shape == found[name].shape else parts[name]
        if is_matrix(name):   # a rank's rows, converted whole (int8's row scales, as one process has them), then
            rows = None if part is None else part[:1]                      # its columns on whole blocks
            w = compact(stored_weight(found, name, rows), fmt, np)
            if part is not None and part[1] != slice(None):
                w = w[:, part[1]] if isinstance(w, np.ndarray) else w.columns(part[1])
            weights[name] = to_device(w, xp)
        else:
            weights[name] = array = xp.empty(shape, dtype=dtype)
            if part is None:
                read_tensor(found[name], array)
            else:
                read_tensor_part(found[name], array, *part)
    return tie_lm_head(config, weights), stack_compact(config, weights)


def compact(w, fmt: str, xp):
    """A stored matrix (compact, or a float32 array) in `fmt`: as it is where it is in that format already
    ("stored": always), else converted a few rows at a time; on `xp`'s device."""
    stored = "float32" if isinstance(w, np.ndarray) else w.format.lower()
    if fmt == "stored" and stored == "float32":
        return xp.asarray(np.array(w, dtype=np.float32))   # an F32 matrix: float32 in memory, as before
    return to_device(convert(w, fmt, stored), xp)


def convert(w, fmt: str, stored: str):
    """A stored matrix in `fmt`, converted a chunk of rows at a time unless it is stored so already."""
    if fmt not in ("stored", stored):
        target = kept_format(fmt, w.shape[1])   # ggml blocks need whole blocks per row: the nearest that fits
        # ggml blocks quantized by THREADS threads, each a part of the chunk's rows (Ggml.quantize): Q4_K's search
        # is numpy passes over 32K values, which let go of the GIL (measured on a 2-core machine whose second core
        # other jobs kept busy: 2 threads did twice one thread's work in 1.54x its time, a 1.30x gain, as a plain
        # numpy loop of passes of that size gained, 1.37x)
        step = max(1, CHUNK_BYTES // 4 // w.shape[1])
        w = join_rows([quantize(float32_rows(w, a, min(a + step, w.shape[0])), target, THREADS)
                       for a in range(0, w.shape[0], step)])
    return w


def to_device(w, xp):
    """A compact matrix's bytes on `xp`'s device as they are (NumPy: unchanged)."""
    if xp is np:
        return w
    if isinstance(w, Ggml):   # quants.py's block code is NumPy's
        raise NpqwenError(f"ggml block formats ({w.format}) run on the CPU; on CUDA load the weights as bfloat16, "
                          f"float16, int8 or float32 (--weights)")
    return xp.asarray(w) if isinstance(w, np.ndarray) else with_arrays(w, [xp.asarray(a) for a in w.arrays])


def compact_weights(config: Qwen3Config, arrays: dict, fmt: str, xp, parts: dict | None = None) -> tuple[dict, dict]:
    """Weights made in memory (the built-in tiny models) with their matrices converted to `fmt`. With `parts`
    (tensor parallelism: HF name -> (rows, columns), see parallel.shards) the whole tensors are then cut to this
    rank's part: a matrix is converted whole first, so a rank's columns (o_proj, down_proj, out_proj) keep one
    process's int8 row scales and ggml blocks, not scales of their own."""
    from .backend import to_numpy
    weights = {}
    for name, a in arrays.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = compact(to_numpy(a), fmt, xp) if is_matrix(name) else a
        weights[name] = w if parts is None else rank_part(w, parts[name])
    return tie_lm_head(config, weights), stack_compact(config, weights)


def stack_compact(config: Qwen3Config, weights: dict) -> dict:
    """The stacked matrices of allocate_weights, of compact parts: qkv_proj and gate_up_proj as Rows (the
    HF-named entries are the parts), a sparse layer's experts as lists (E gate_up Rows, E down_proj)."""
    fused = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        if not config.is_linear_layer(i):
            fused[f"{p}.self_attn.qkv_proj.weight"] = Rows([weights[f"{p}.self_attn.{t}_proj.weight"] for t in "qkv"])
        if not config.is_linear_layer(i) and config.attention_bias:   # Qwen2: the float32 biases stacked as the rows
            names = [f"{p}.self_attn.{t}_proj.bias" for t in "qkv"]
            stacked = fused[f"{p}.self_attn.qkv_proj.bias"] = xp_of(weights[names[0]]).concatenate(
                [weights[n] for n in names])                                                     # (Q + 2K*Dh,)
            for n, start in zip(names, np.cumsum([0] + [weights[n].shape[0] for n in names])):
                weights[n] = stacked[start:start + weights[n].shape[0]]   # the HF-named entries: views into it
        mlp = f"{p}.mlp.shared_expert" if config.is_moe_layer(i) else f"{p}.mlp"
        if f"{mlp}.gate_proj.weight" in weights:
            fused[f"{mlp}.gate_up_proj.weight"] = Rows([weights[f"{mlp}.gate_proj.weight"],
                                                        weights[f"{mlp}.up_proj.weight"]])
        if config.is_moe_layer(i):
            E = range(config.num_experts)
            fused[f"{p}.mlp.experts.gate_up_proj"] = [
                Rows([weights[f"{p}.mlp.experts.{e}.gate_proj.weight"], weights[f"{p}.mlp.experts.{e}.up_proj.weight"]])
                for e in E]
            fused[f"{p}.mlp.experts.down_proj"] = [weights[f"{p}.mlp.experts.{e}.down_proj.weight"] for e in E]
    return fused


def check_fits_compact(found: dict, shapes: dict, fmt: str, xp, directory) -> None:
    """check_fits for compact weights: each matrix's bytes in its format, the rest in float32."""
    need = 0
    for name, shape in shapes.items():
        if not is_matrix(name) or (fmt == "stored" and name not in found):   # (Qwen3-VL-MoE's experts: at most)
            need += math.prod(shape) * 4
        elif fmt == "stored":
            need += (found[name].end - found[name].start) * math.prod(shape) // math.prod(matrix_shape(found[name]))
        else:
            need += matrix_bytes(fmt, shape)
    free = free_memory_bytes(xp)
    if need > free:
        raise NpqwenError(f"{directory}: the weights need {size(need)} as {fmt} but {'the host' if xp is np else 'the GPU'} "
                          f"has {size(free)} free; use a machine with more memory or a smaller format (--weights q4_k)")


def fused_expert_tensors(config: Qwen3Config, found: dict, directory, parts) -> dict:
    """Qwen3-VL-MoE's layout, checked: each sparse layer's experts as two tensors, mlp.experts.gate_up_proj
    and mlp.experts.down_proj, either as transformers holds them, (E, 2I, D) (each expert's gate rows, then its up
    rows) and (E, D, I), or as the hub's files store them, transposed for x @ W: (E, D, 2I) and (E, I, D).
    As transformers does, a tensor whose shape is already the in-memory one is read as it is, any other is
    transposed. Layer's experts prefix -> {"stored": [the two TensorInfos], "names": the per-expert HF names
    they hold}; {} for every other checkpoint."""
    if not config.fused_experts:
        return {}
    if parts is not None:
        raise NpqwenError(f"{directory}: tensor parallelism does not split Qwen3-VL-MoE's stored expert tensors "
                          f"(mlp.experts.gate_up_proj) yet; run it in one process")
    E, I, D = config.num_experts, config.moe_intermediate_size, config.hidden_size
    layers = {}
    for i in range(config.num_hidden_layers):
        if not config.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp.experts"
        stored = []
        for name, shape in ((f"{p}.gate_up_proj", (E, 2 * I, D)), (f"{p}.down_proj", (E, D, I))):
            if name not in found:
                raise NpqwenError(f"{directory}: tensor {name!r} is missing (expected shape {list(shape)}, "
                                  f"Qwen3-VL-MoE's experts); the checkpoint does not match its config.json")
            info = found[name]
            if info.shape not in (shape, (E, shape[2], shape[1])) or info.dtype not in STORED_DTYPES:
                raise NpqwenError(f"{directory}: tensor {name!r} has shape {list(info.shape)} {info.dtype}, "
                                  f"expected {list(shape)} or its transpose {[E, shape[2], shape[1]]} from "
                                  f"config.json (E experts, D hidden, I expert width), in BF16, F16 or F32")
            stored.append(info)
        names = {f"{p}.{e}.{part}.weight" for e in range(E) for part in ("gate_proj", "up_proj", "down_proj")}
        layers[p] = {"stored": stored, "names": names}
    return layers


def read_fused_experts(stored: list, gate_up, down):
    """One layer's experts from Qwen3-VL-MoE's two stored tensors into npqwen's (transformers' in-memory) layout,
    gate_up (E, 2I, D) and down (E, D, I), one expert's slab at a time."""
    for info, out in zip(stored, (gate_up, down)):
        for e, slab in enumerate(expert_slabs(info, out.shape[1:], xp_of(out), out.dtype)):
            out[e] = slab


def expert_slabs(info: TensorInfo, shape: tuple, xp, dtype):
    """Each expert's matrix of a stored Qwen3-VL-MoE expert tensor, one at a time, in the in-memory layout `shape`
    ((2I, D) or (D, I)): read as it is, or transposed where the file holds (E, D, 2I) and (E, I, D)."""
    slab = xp.empty(info.shape[1:], dtype=dtype)                      # one expert as stored
    per_expert = (info.end - info.start) // info.shape[0]             # its bytes
    for e in range(info.shape[0]):
        read_tensor(TensorInfo(info.name, info.file, info.dtype, info.shape[1:], info.start + e * per_expert,
                               info.start + (e + 1) * per_expert), slab)
        yield slab if slab.shape == shape else slab.T


def compact_experts(p: str, stored: list, fmt: str, xp, I: int, D: int) -> dict:
    """Qwen3-VL-MoE's experts of layer prefix p as compact weights under HF's per-expert names: each expert's
    float32 slab (expert_slabs) split into gate and up, converted to `fmt` ("stored": the file's bfloat16 or
    float16 again, exact). A copy per expert: the file's (E, D, 2I) layout is not the (rows, in) one."""
    gate_up, down = stored
    out = {}
    for info, shape, parts in ((gate_up, (2 * I, D), ("gate_proj", "up_proj")), (down, (D, I), ("down_proj",))):
        target = {"BF16": "bfloat16", "F16": "float16"}.get(info.dtype, "float32") if fmt == "stored" else fmt
        for e, slab in enumerate(expert_slabs(info, shape, np, np.float32)):
            for k, part in enumerate(parts):
                rows = np.array(slab[k * I:(k + 1) * I] if len(parts) == 2 else slab)   # (I, D) / (D, I), a copy
                out[f"{p}.{e}.{part}.weight"] = compact(rows, target, xp) if target != "float32" else xp.asarray(rows)
    return out


def family_hint(config: Qwen3Config, missing: str) -> str:
    """Why a Qwen2 checkpoint read as a Qwen3 (or the other way) lacks a tensor: QK-norm is Qwen3's, q/k/v biases
    Qwen2's."""
    if missing.endswith(("q_norm.weight", "k_norm.weight")):
        return " (Qwen3 has QK-norm; a Qwen2 / Qwen2.5 checkpoint has none: its config.json says model_type 'qwen2')"
    if missing.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return " (Qwen2 has biases on q, k and v; a Qwen3 checkpoint has none: model_type 'qwen3')"
    return ""


def check_fits(shapes: dict, xp, dtype, directory) -> None:
    """Refuse, before reading a byte of them, weights that the free memory cannot hold."""
    need = sum(math.prod(shape) for shape in shapes.values()) * np.dtype(dtype).itemsize
    free = free_memory_bytes(xp)
    if need > free:
        where = "the host" if xp is np else "the GPU"
        smaller = " or dtype float16 (half the bytes)" if xp is not np and np.dtype(dtype).itemsize > 2 else ""
        raise NpqwenError(f"{directory}: the weights need {size(need)} in {np.dtype(dtype).name} but {where} has "
                          f"{size(free)} free; use a machine with more memory{smaller} (docs/moe.md: which sizes "
                          f"fit which memory)")


def size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def allocate_weights(config: Qwen3Config, xp, dtype, shapes: dict | None = None) -> tuple[dict, dict]:
    """Empty arrays for every HF tensor (in checkpoint order), q/k/v and gate/up as views of stacked matrices;
    a sparse layer's experts as views of its two expert arrays. `shapes`: other shapes than the HF ones (a
    tensor-parallel rank's parts; no lm_head.weight for a checkpoint saved from Qwen3Model)."""
    shapes = shapes or expected_shapes(config)
    fused, views = {}, {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        if config.is_moe_layer(i):
            views.update(allocate_experts(config, p, xp, dtype, fused, shapes))
        mlp = () if config.is_moe_layer(i) else ((f"{p}.mlp.gate_up_proj.weight", ("gate_proj", "up_proj")),)
        if config.is_moe_layer(i) and config.shared_expert_intermediate_size:   # Qwen3.5-MoE: the shared expert
            mlp = ((f"{p}.mlp.shared_expert.gate_up_proj.weight", ("gate_proj", "up_proj")),)
        attn = () if config.is_linear_layer(i) else ((f"{p}.self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj")),)
        if attn and config.attention_bias:   # Qwen2: q, k, v's biases stacked the same way, (Q + 2K*Dh,)
            attn += ((f"{p}.self_attn.qkv_proj.bias", ("q_proj", "k_proj", "v_proj")),)
        for stacked, parts in (*attn, *mlp):
            names = [stacked.replace("qkv_proj" if "qkv" in stacked else "gate_up_proj", part)
                     for part in parts]
            rows = [shapes[n][0] for n in names]
            fused[stacked] = xp.empty((sum(rows), *shapes[names[0]][1:]), dtype=dtype)
            for n, start, r in zip(names, np.cumsum([0] + rows), rows):
                views[n] = fused[stacked][start:start + r]   # a view into the stacked matrix
    weights = {name: views[name] if name in views else xp.empty(shape, dtype=dtype)
               for name, shape in shapes.items()}
    return weights, fused


def allocate_experts(config: Qwen3Config, p: str, xp, dtype, fused: dict, shapes: dict) -> dict:
    """Layer p's experts as two arrays in `fused` (transformers' in-memory names and layout):
    p.mlp.experts.gate_up_proj (E, 2I, D), gate_proj rows then up_proj rows of each expert, and
    p.mlp.experts.down_proj (E, D, I). Returns each expert's HF-named views into them. I is `shapes`' (a
    tensor-parallel rank's I/N)."""
    E, I, D = config.num_experts, shapes[f"{p}.mlp.experts.0.gate_proj.weight"][0], config.hidden_size
    gate_up = fused[f"{p}.mlp.experts.gate_up_proj"] = xp.empty((E, 2 * I, D), dtype=dtype)
    down = fused[f"{p}.mlp.experts.down_proj"] = xp.empty((E, D, I), dtype=dtype)
    views = {}
    for e in range(E):
        views[f"{p}.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :I]   # (I, D)
        views[f"{p}.mlp.experts.{e}.up_proj.weight"] = gate_up[e, I:]     # (I, D)
        views[f"{p}.mlp.experts.{e}.down_proj.weight"] = down[e]          # (D, I)
    return views


def tie_lm_head(config: Qwen3Config, weights: dict) -> dict:
    """With tie_word_embeddings, lm_head.weight is the embedding itself (the same array, not a copy)."""
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def save_safetensors(path: Path, tensors: dict, dtype: str = "F32"):
    """Write float arrays as one .safetensors file in `dtype` ("F32", "F16" or "BF16"), a tensor at a time;
    int64 arrays (Qwen4-Exp's PLE hash constants) as I64, unchanged."""
    if dtype not in STORED_DTYPES:
        raise NpqwenError(f"cannot write dtype {dtype}; use one of {', '.join(STORED_DTYPES)}")
    header, offset = {}, 0
    for name, a in tensors.items():
        kind = "I64" if getattr(a, "dtype", None) == np.int64 else dtype
        nbytes = math.prod(a.shape) * SAFETENSORS_ITEMSIZE[kind]
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, a in tensors.items():
            if header[name]["dtype"] == "I64":
                f.write(np.ascontiguousarray(a).data)
                continue
            a = np.asarray(as_array(a), dtype=np.float32)   # a compact weight widened here, one at a time
            bits = float32_to_bf16_bits(a) if dtype == "BF16" else a.astype(STORED_DTYPES[dtype][0])
            f.write(np.ascontiguousarray(bits).data)


def stored_pieces(name: str, w) -> list[tuple[str, str, np.ndarray]]:
    """What one weight is on disk, as `npqwen quantize` writes it: [(tensor name, safetensors dtype, array)].
    bfloat16 BF16, float16 F16, float32 F32; int8 as I8 with its row scales `...weight_scale` (F32, (out,));
    ggml blocks as U8 rows (out, bytes per row), their type in the file's __metadata__ (name -> "Q4_K");
    a PLE table as its shards (ngram_embedding.shard_J.weight), copied from the file that held them."""
    from .backend import to_numpy
    if isinstance(w, BFloat16):
        return [(name, "BF16", w.storage)]
    if isinstance(w, Float16):
        return [(name, "F16", w.storage)]
    if isinstance(w, Int8):
        return [(name, "I8", w.storage), (name[:-len("weight")] + "weight_scale", "F32", w.scale)]
    if isinstance(w, Ggml):
        return [(name, "U8", w.storage)]
    if isinstance(w, FP8):
        raise NpqwenError("FP8 weights are written by the checkpoint that made them; convert them with --to")
    if hasattr(w, "parts"):   # Qwen4-Exp's PLE table (ple.NgramTable): its shards' bytes as stored, never widened
        kinds = {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}
        return [(f"{name[:-len('weight')]}shard_{j}.weight", kinds[part.dtype], part) for j, part in enumerate(w.parts)]
    return [(name, "F32", np.asarray(to_numpy(w), dtype=np.float32))]


def save_compact(path: Path, weights: dict):
    """Write weights (arrays and compact matrices, npqwen/weights.py) as one .safetensors file in their
    formats (stored_pieces), a tensor at a time; npqwen.load reads it back as stored."""
    pieces = [piece for name, w in weights.items() for piece in stored_pieces(name, w)]
    metadata = {name: w.format for name, w in weights.items() if isinstance(w, Ggml)}
    header, offset = {"__metadata__": metadata} if metadata else {}, 0
    for name, dtype, a in pieces:
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, _, a in pieces:
            f.write(np.ascontiguousarray(a).data)
