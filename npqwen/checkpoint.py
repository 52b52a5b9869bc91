"""Read a Hugging Face Qwen3 checkpoint directory without torch: config.json + safetensors.

A .safetensors file is an 8-byte little-endian header length N, N bytes of JSON that give
each tensor's dtype, shape and byte range, then the raw tensor bytes. We read it with
np.memmap rather than the `safetensors` package because its NumPy loader has no bfloat16
(NumPy has no such dtype) and Qwen3 checkpoints are bfloat16: bf16 is just the top 16 bits
of a float32, so widening it is one shift (`bf16_bits_to_float32`).

Weights keep their HF names and shapes. For speed, each layer's q/k/v projections are
stacked into one `qkv_proj` matrix and gate/up into one `gate_up_proj` matrix; the
HF-named entries are row-slices (views) of those, so writing to one changes the other.
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backend import xp_of
from .config import Qwen3Config
from .errors import NpqwenError

# safetensors dtype -> (NumPy dtype of the stored bits, bytes per element)
STORED_DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4)}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # as the safetensors specification
CHUNK_BYTES = 32 * 1024 * 1024        # convert this much at a time to keep peak memory low


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, stored dtype, shape and absolute byte range."""
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check a .safetensors header: every byte range must lie inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise NpqwenError(f"{path}: not a safetensors file or truncated (file is {size} bytes, header says "
                              f"{n} header bytes); download it again")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise NpqwenError(f"{path}: corrupt safetensors header ({e}); download the file again") from e
    if not isinstance(header, dict):
        raise NpqwenError(f"{path}: corrupt safetensors header (not a JSON object); download the file again")
    header.pop("__metadata__", None)
    data_start = 8 + n
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            assert all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(begin, int)
        except (KeyError, TypeError, ValueError, AssertionError):
            raise NpqwenError(f"{path}: corrupt safetensors header entry for {name!r}: {entry!r}") from None
        if dtype not in STORED_DTYPES:
            raise NpqwenError(f"{path}: tensor {name!r} has dtype {dtype}; npqwen reads BF16, F16 and F32 "
                              f"(quantized checkpoints are unsupported)")
        nbytes = math.prod(shape) * STORED_DTYPES[dtype][1]
        if end - begin != nbytes:
            raise NpqwenError(f"{path}: corrupt header: tensor {name!r} of shape {list(shape)} {dtype} needs "
                              f"{nbytes} bytes but its byte range holds {end - begin}")
        if data_start + end > size:
            raise NpqwenError(f"{path} is truncated: tensor {name!r} ends at byte {data_start + end} but the "
                              f"file has {size} bytes; download it again")
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, data_start + end)
    return tensors


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
        if not (directory / name).is_file():
            raise NpqwenError(f"{directory}: shard {name} named in model.safetensors.index.json is missing")
        tensors.update(read_safetensors_header(directory / name))
    if weight_map is not None:
        for key, file in weight_map.items():
            if key not in tensors:
                raise NpqwenError(f"{directory / file}: tensor {key!r} listed in the index is not in the file")
    return tensors


def expected_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Qwen3 checkpoint must hold, by HF name, with its HF shape (out, in)."""
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    H, K, Dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (D,),
            f"{p}.self_attn.q_proj.weight": (H * Dh, D),
            f"{p}.self_attn.k_proj.weight": (K * Dh, D),
            f"{p}.self_attn.v_proj.weight": (K * Dh, D),
            f"{p}.self_attn.q_norm.weight": (Dh,),
            f"{p}.self_attn.k_norm.weight": (Dh,),
            f"{p}.self_attn.o_proj.weight": (D, H * Dh),
            f"{p}.post_attention_layernorm.weight": (D,),
            f"{p}.mlp.gate_proj.weight": (F, D),
            f"{p}.mlp.up_proj.weight": (F, D),
            f"{p}.mlp.down_proj.weight": (D, F),
        })
    shapes["model.norm.weight"] = (D,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def bf16_bits_to_float32(bits, out):
    """Widen bfloat16 bit patterns (uint16) into float32 `out`: bf16 is a float32's top 16 bits."""
    xp = xp_of(out)
    if out.dtype == xp.float32:
        wide = out.view(xp.uint32)   # write in place, no temporary
        wide[...] = bits
        wide <<= 16
    else:
        out[...] = (bits.astype(xp.uint32) << 16).view(xp.float32)


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
    if not bool(xp.isfinite(out).all()):
        raise NpqwenError(f"{info.file}: tensor {info.name!r} holds NaN or infinite values; the file is "
                          f"corrupt, download it again")


def load_weights(directory: Path, config: Qwen3Config, xp, dtype) -> tuple[dict, dict]:
    """Read every expected tensor into arrays of `dtype` on `xp`'s device.

    Returns (weights, fused): `weights` maps each HF name to an array of its HF shape;
    `fused` holds the stacked per-layer matrices `...self_attn.qkv_proj.weight` and
    `...mlp.gate_up_proj.weight` that the HF q/k/v and gate/up entries are views of.
    """
    found = index_checkpoint(directory)
    shapes = expected_shapes(config)
    for name, shape in shapes.items():
        if name not in found:
            raise NpqwenError(f"{directory}: tensor {name!r} is missing (expected shape {list(shape)}); "
                              f"the checkpoint does not match its config.json")
        if found[name].shape != shape:
            raise NpqwenError(f"{directory}: tensor {name!r} has shape {list(found[name].shape)}, expected "
                              f"{list(shape)} from config.json")
    weights, fused = allocate_weights(config, xp, dtype)
    for name, array in weights.items():
        read_tensor(found[name], array)
    return tie_lm_head(config, weights), fused


def allocate_weights(config: Qwen3Config, xp, dtype) -> tuple[dict, dict]:
    """Empty arrays for every HF tensor (in checkpoint order), q/k/v and gate/up as views of stacked matrices."""
    shapes = expected_shapes(config)
    fused, views = {}, {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for stacked, parts in ((f"{p}.self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj")),
                               (f"{p}.mlp.gate_up_proj.weight", ("gate_proj", "up_proj"))):
            names = [stacked.replace("qkv_proj" if "qkv" in stacked else "gate_up_proj", part)
                     for part in parts]
            rows = [shapes[n][0] for n in names]
            fused[stacked] = xp.empty((sum(rows), config.hidden_size), dtype=dtype)
            for n, start, r in zip(names, np.cumsum([0] + rows), rows):
                views[n] = fused[stacked][start:start + r]   # a view into the stacked matrix
    weights = {name: views[name] if name in views else xp.empty(shape, dtype=dtype)
               for name, shape in shapes.items()}
    return weights, fused


def tie_lm_head(config: Qwen3Config, weights: dict) -> dict:
    """With tie_word_embeddings, lm_head.weight is the embedding itself (the same array, not a copy)."""
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def float32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even, as torch does) and return the uint16 bits."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def save_safetensors(path: Path, tensors: dict, dtype: str = "F32"):
    """Write float arrays as one .safetensors file in `dtype` ("F32", "F16" or "BF16"), a tensor at a time."""
    if dtype not in STORED_DTYPES:
        raise NpqwenError(f"cannot write dtype {dtype}; use one of {', '.join(STORED_DTYPES)}")
    itemsize = STORED_DTYPES[dtype][1]
    header, offset = {}, 0
    for name, a in tensors.items():
        nbytes = math.prod(a.shape) * itemsize
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # pad so the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in tensors.values():
            a = np.asarray(a, dtype=np.float32)
            bits = float32_to_bf16_bits(a) if dtype == "BF16" else a.astype(STORED_DTYPES[dtype][0])
            f.write(np.ascontiguousarray(bits).data)
