"""Where keys and values live, and how one forward pass addresses them.

`KVCache` is the storage: every layer's keys and values in pages of P positions. A `Batch` is one
packed forward pass: which tokens run, at which positions, and which pages hold each sequence's
keys and values (its page table). `SequenceCache` is one sequence's pages in order, for the
single-sequence API (`Qwen3.forward`, `prefill`, `decode_one_token`). The engine (npqwen/engine/)
decides what goes into a Batch; the model (npqwen/model.py) only reads and writes what it says.

A hybrid model (Qwen3.5) keeps keys and values for its full-attention layers only; each
linear-attention layer keeps a fixed-size state per sequence instead, in `LinearStates` slots (a
Batch names each sequence's slot). The state does not grow with the context.

Keys and values may be kept compact (`kv_dtype`: bfloat16, float8 e4m3 or int8 rows with a scale each) and
widened to the compute dtype one page at a time when attention reads it (`CompactPages`), as compact
weights are widened per block (npqwen/weights.py).

Qwen4-Exp's attention layers are QSA (npqwen/qsa.py): beside each position's key and value its pages keep the
indexer's raw key (`index_keys`, one head of di), from which each query's selection of blocks is recomputed;
its PLE layers keep, per sequence, their dilated convolution's last inputs and the last ngram_size - 1 tokens.

Shapes: L layers, N pages, P positions per page, K key/value heads (this rank's), Dh head dim,
T tokens in a batch; Ll linear-attention layers, S state slots, W conv kernel, C convolved channels,
Hv value heads of dv (this rank's), dk key head dim.
"""
import functools
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .backend import xp_of
from .config import Qwen3Config
from .errors import NpqwenError
from .weights import E4M3, bf16_bits_to_float32, float32_to_bf16_bits

KV_CACHE_DTYPES = ("auto", "bfloat16", "float8_e4m3", "int8")   # vLLM's --kv-cache-dtype; auto: the compute dtype


class KVCache:
    """Keys and values of every layer, in N pages of P positions each: (layers, N, K, P, Dh).

    A page is one contiguous (K, P, Dh) block: a new token's key is one contiguous row of Dh
    values, and attention reads a page with one matrix product per page. Which page holds which
    positions of which sequence is the page table's business (a `Batch` carries one per sequence);
    the cache is only storage.
    Zero-filled memory costs nothing until written, so on the CPU a large cache only becomes
    resident as pages are used.
    """

    def __init__(self, config: Qwen3Config, num_pages: int, page_size: int, xp, dtype, kv_heads: int | None = None,
                 num_slots: int = 1, linear_heads: tuple[int, int] | None = None, kv_dtype: str = "auto"):
        L, K, Dh = config.num_attention_layers, kv_heads or config.num_key_value_heads, config.head_dim   # K: this rank's
        shape = (L, num_pages, K, page_size, Dh)
        check_kv_dtype(kv_dtype)
        if config.qwen4_exp and kv_dtype != "auto":
            raise NpqwenError(f"kv_cache_dtype {kv_dtype!r}: Qwen4-Exp's QSA attention reads its pages whole, not "
                              f"a compact page at a time; use kv_cache_dtype 'auto' for it")
        self.kv_dtype = kv_dtype
        try:
            if kv_dtype == "auto":   # the compute dtype: attention reads the pages as they are
                self.keys = xp.zeros(shape, dtype=dtype)       # (L, N, K, P, Dh)
                self.values = xp.zeros(shape, dtype=dtype)     # (L, N, K, P, Dh)
            else:                    # compact: widened a page at a time as attention reads it
                self.keys = CompactPages.zeros(shape, kv_dtype, xp, dtype)      # (L, N, K, P, Dh) as kv_dtype
                self.values = CompactPages.zeros(shape, kv_dtype, xp, dtype)
        except MemoryError as e:   # NumPy's _ArrayMemoryError and CuPy's OutOfMemoryError are both MemoryErrors
            need = 2 * math.prod(shape[:-1]) * kv_bytes_per_row(Dh, kv_dtype, dtype)
            raise NpqwenError(f"a KV cache of {num_pages} pages x {page_size} positions needs "
                              f"{need / 2**30:.2f} GiB, which cannot be allocated; use fewer pages") from e
        self.num_pages, self.page_size = num_pages, page_size
        # Qwen4-Exp: QSA's raw indexer key of every position, paged like the keys (L, N, P, di)
        self.index_keys = (xp.zeros((L, num_pages, page_size, config.indexer_head_dim), dtype=dtype)
                           if config.qwen4_exp else None)
        self.states = LinearStates(config, num_slots, xp, dtype, linear_heads) if config.hybrid else None
        self.snapshots: LinearStates | None = None   # the engine's snapshots of states, for prefix hits (hybrid)
        self.state_copies: list | None = None        # tensor parallel: rank 0's copies between the two and its
                                                     # speculative roll-backs since its last batch, for the other
                                                     # ranks to make (parallel.cache_key)

    def slots(self, pages, offsets):
        """Where token t's key of kv head h goes, as a row of a layer seen as (N*K*P, Dh) rows:
        (T*K,) row numbers for tokens at page pages[t], position offsets[t] within the page."""
        K, P = self.keys.shape[2], self.page_size
        return ((pages[:, None] * K + np.arange(K)) * P + offsets[:, None]).reshape(-1)   # (T*K,), h fastest

    def write(self, layer: int, slots, k, v):
        """Store k, v (T, K, Dh) at their slots: one row copy of Dh values per token and kv head."""
        Dh = k.shape[-1]
        if self.kv_dtype != "auto":
            self.keys.write(layer, slots, k.reshape(-1, Dh))                 # encoded row by row
            self.values.write(layer, slots, v.reshape(-1, Dh))
            return
        self.keys[layer].reshape(-1, Dh)[slots] = k.reshape(-1, Dh)          # (N*K*P, Dh)[(T*K,)] = (T*K, Dh)
        self.values[layer].reshape(-1, Dh)[slots] = v.reshape(-1, Dh)

    def write_index_keys(self, layer: int, pages, offsets, keys):
        """Qwen4-Exp: store QSA's raw indexer keys (T, di) of tokens at pages[t], offsets[t]."""
        self.index_keys[layer].reshape(-1, keys.shape[-1])[pages * self.page_size + offsets] = keys   # (N*P, di)

    def page_arrays(self, page: int) -> list:
        """Everything stored for one page, every layer (keys, values, and int8's scales): what the prefix
        cache's disk tier writes (npqwen/engine/prefix_disk.py)."""
        index = [self.index_keys[:, page]] if self.index_keys is not None else []   # Qwen4-Exp: (L, P, di)
        if self.kv_dtype == "auto":
            return [self.keys[:, page], self.values[:, page], *index]           # (L, K, P, Dh) each
        return [a[:, page] for store in (self.keys, self.values) for a in store.arrays] + index

    def set_page_arrays(self, page: int, arrays: list):
        """The inverse of page_arrays: fill one page, every layer."""
        stores = [self.keys, self.values] if self.kv_dtype == "auto" else \
            [a for store in (self.keys, self.values) for a in store.arrays]
        stores += [self.index_keys] if self.index_keys is not None else []
        for store, a in zip(stores, arrays, strict=True):
            store[:, page] = xp_of(store).asarray(a)

    @property
    def nbytes(self) -> int:
        return (self.keys.nbytes + self.values.nbytes + (self.states.nbytes if self.states is not None else 0)
                + (self.index_keys.nbytes if self.index_keys is not None else 0))

    @staticmethod
    def bytes_per_token(config: Qwen3Config, dtype, kv_dtype: str = "auto") -> int:
        """Keys + values of one position in every full-attention layer (all layers of a Qwen3), as stored; and in
        Qwen4-Exp QSA's raw indexer key (in the compute dtype)."""
        index = config.indexer_head_dim * np.dtype(dtype).itemsize if config.qwen4_exp else 0
        return config.num_attention_layers * (2 * config.num_key_value_heads
                                              * kv_bytes_per_row(config.head_dim, kv_dtype, dtype) + index)


def check_kv_dtype(kv_dtype: str):
    if kv_dtype not in KV_CACHE_DTYPES:
        raise NpqwenError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_dtype!r}")


def kv_bytes_per_row(Dh: int, kv_dtype: str, dtype) -> int:
    """One token's key (or value) of one head as stored: Dh values, and int8's float32 scale."""
    return {"auto": Dh * np.dtype(dtype).itemsize, "bfloat16": 2 * Dh, "float8_e4m3": Dh, "int8": Dh + 4}[kv_dtype]


class CompactPages:
    """Keys (or values) stored compact, (L, N, K, P, Dh) of `kv_dtype`, read as the compute dtype one page
    at a time: `pages[layer]` is one layer's store and `pages[layer][page, :, :w]` widens just that page's
    (K, w, Dh), which is how ops.paged_attention reads a page. Writing encodes each new (Dh,) row:
        bfloat16     uint16: a float32's top 16 bits, rounded to nearest even   widened by a shift
        float8_e4m3  uint8: the nearest e4m3fn value, saturated at +-448        widened by a 256-entry table
        int8         int8 of row / scale, scale = max|row| / 127, one per row   widened times the row's scale
    int8 keeps a scale per token and head, not per page: a page's scale would have to be known before its
    last token is written."""

    def __init__(self, data, scale, kv_dtype: str, dtype):
        self.data, self.scale = data, scale            # (..., Dh) codes; int8: (...,) float32 scales, else None
        self.kv_dtype, self.dtype = kv_dtype, np.dtype(dtype)
        self.shape = data.shape

    @classmethod
    def zeros(cls, shape, kv_dtype: str, xp, dtype):
        code = {"bfloat16": np.uint16, "float8_e4m3": np.uint8, "int8": np.int8}[kv_dtype]
        scale = xp.zeros(shape[:-1], dtype=np.float32) if kv_dtype == "int8" else None
        return cls(xp.zeros(shape, dtype=code), scale, kv_dtype, dtype)

    @property
    def arrays(self) -> list:
        return [self.data] if self.scale is None else [self.data, self.scale]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def __getitem__(self, index):
        """A layer (an int into (L, ...)): its store; anything else, e.g. [page, :, :w]: those values, widened."""
        if isinstance(index, (int, np.integer)) and self.data.ndim == 5:
            return CompactPages(self.data[index], None if self.scale is None else self.scale[index], self.kv_dtype,
                                self.dtype)
        return widen_kv(self.data[index], None if self.scale is None else self.scale[index], self.kv_dtype,
                        self.dtype)

    def write(self, layer: int, slots, rows):
        """Encode rows (T*K, Dh) into their slots of one layer, seen as (N*K*P, Dh) rows."""
        Dh = rows.shape[-1]
        codes, scale = encode_kv(rows, self.kv_dtype)
        self.data[layer].reshape(-1, Dh)[slots] = codes                      # (N*K*P, Dh)[(T*K,)] = (T*K, Dh)
        if scale is not None:
            self.scale[layer].reshape(-1)[slots] = scale                     # (N*K*P,)[(T*K,)] = (T*K,)


E4M3_CODES = np.arange(127, dtype=np.uint8)                                # 0 .. 448: the finite non-negative codes
E4M3_MIDPOINTS = (E4M3[1:127] + E4M3[:126]) / 2                            # (126,) between neighbouring values


def encode_kv(rows, kv_dtype: str):
    """Rows (n, Dh) in the compute dtype -> (codes (n, Dh), int8's scales (n,) or None)."""
    xp = xp_of(rows)
    if kv_dtype == "bfloat16":
        return float32_to_bf16_bits(rows), None
    if kv_dtype == "float8_e4m3":   # the nearest of e4m3's values (|x| past 448 saturates), then the sign bit
        code = xp.searchsorted(xp.asarray(E4M3_MIDPOINTS), xp.abs(rows.astype(np.float32))).astype(np.uint8)
        return code | (rows < 0).astype(np.uint8) << np.uint8(7), None
    scale = xp.abs(rows).max(axis=-1).astype(np.float32) / 127                  # (n,) int8: one scale per row
    q = xp.rint(rows / xp.where(scale == 0, 1, scale)[:, None])                  # (n, Dh) in -127 .. 127
    return q.astype(np.int8), scale


def widen_kv(codes, scale, kv_dtype: str, dtype):
    """Stored codes (..., Dh) (and int8's scales (...,)) -> the values in the compute dtype."""
    xp = xp_of(codes)
    if kv_dtype == "bfloat16":
        out = xp.empty(codes.shape, dtype=dtype)
        bf16_bits_to_float32(codes, out)
        return out
    if kv_dtype == "float8_e4m3":
        return e4m3_table(xp, np.dtype(dtype))[codes]
    return codes.astype(dtype) * scale[..., None].astype(dtype)


@functools.cache
def e4m3_table(xp, dtype):
    """The 256 e4m3 values in `dtype` on xp's device, made once (not copied to a GPU at every page)."""
    return xp.asarray(E4M3, dtype=dtype)


class LinearStates:
    """Every linear-attention layer's state for S sequences (slots): the convolution's last W-1 inputs
    (Ll, S, W-1, C) and the delta rule's matrices (Ll, S, Hv, dk, dv), in (at least) float32 as HF keeps them.
    `heads`: (Hk, Hv) of a tensor-parallel rank, whose slots hold only its own heads' states; default all."""

    def __init__(self, config: Qwen3Config, num_slots: int, xp, dtype, heads: tuple[int, int] | None = None):
        Ll = config.num_hidden_layers - config.num_attention_layers
        self.conv = xp.zeros((Ll, num_slots, *conv_state_shape(config, heads)), dtype=dtype)   # (Ll, S, W-1, C)
        self.recurrent = xp.zeros((Ll, num_slots, *recurrent_state_shape(config, heads)),
                                  dtype=np.promote_types(dtype, np.float32))          # (Ll, S, Hv, dk, dv)
        self.num_slots = num_slots
        # Qwen4-Exp's PLE layers: the dilated convolution's last inputs (Lp, S, L, C*D) and each sequence's last
        # ngram_size - 1 tokens (S, n-1), end-of-text before its first (an n-gram starts there)
        Lp = len(config.ple_layer_ids)
        self.eos = config.eos_token_ids[0] if Lp else 0
        self.ple_conv = xp.zeros((Lp, num_slots, *ple_conv_state_shape(config)), dtype=dtype) if Lp else None
        self.ple_ids = np.full((num_slots, config.ngram_size - 1), self.eos, dtype=np.int64) if Lp else None
        # speculative decoding: a verifying sequence's slot -> per linear layer (the conv's inputs (W-1+n, C) from
        # its state on, the delta rule's state after each of its n tokens (n, Hv, dk, dv)), until roll_back
        self.verified: dict[int, dict] = {}
        # ... and Qwen4-Exp's: slot -> {PLE layer j: its convolution's state after each of the n tokens (n, L, C*D),
        # "ids": the n-gram history, its ngram_size - 1 earlier tokens then the n verified ones (ngram_size - 1 + n,)}
        self.ple_verified: dict[int, dict] = {}

    def roll_back(self, slot: int, kept: int):
        """A verification kept its first `kept` tokens: the slot's states become those after them (the
        convolution's last W-1 inputs up to there, the delta rule's state after token kept - 1; Qwen4-Exp's PLE
        convolutions' states after token kept - 1 and the last n-1 tokens up to there)."""
        for layer, (inputs, states) in self.verified.pop(slot, {}).items():   # (none: no linear layer ran)
            W1 = self.conv.shape[2]
            self.conv[layer, slot] = inputs[kept:kept + W1]                  # (W-1, C)
            self.recurrent[layer, slot] = states[kept - 1]                   # (Hv, dk, dv)
        ple = self.ple_verified.pop(slot, {})
        if "ids" in ple:
            self.ple_ids[slot] = ple.pop("ids")[kept:kept + self.ple_ids.shape[1]]    # (n-1,)
        for j, states in ple.items():
            self.ple_conv[j, slot] = states[kept - 1]                        # (L, C*D)

    def reset(self, slots):
        """A sequence that starts (position 0) starts from zero states."""
        if len(slots):
            self.conv[:, slots] = 0
            self.recurrent[:, slots] = 0
            if self.ple_conv is not None:
                self.ple_conv[:, slots] = 0
                self.ple_ids[slots] = self.eos

    @property
    def nbytes(self) -> int:
        ple = self.ple_conv.nbytes + self.ple_ids.nbytes if self.ple_conv is not None else 0
        return self.conv.nbytes + self.recurrent.nbytes + ple

    @staticmethod
    def bytes_per_slot(config: Qwen3Config, dtype) -> int:
        """One sequence's states in every linear-attention layer: the same at any context length."""
        Ll, Lp = config.num_hidden_layers - config.num_attention_layers, len(config.ple_layer_ids)
        ple = Lp * math.prod(ple_conv_state_shape(config)) * np.dtype(dtype).itemsize + 8 * (config.ngram_size - 1)
        return Ll * (math.prod(conv_state_shape(config)) * np.dtype(dtype).itemsize
                     + math.prod(recurrent_state_shape(config)) * np.promote_types(dtype, np.float32).itemsize) \
            + (ple if Lp else 0)


def copy_states(src: LinearStates, i: int, dst: LinearStates, j: int):
    """Slot i of src -> slot j of dst, in every linear-attention layer."""
    dst.conv[:, j] = src.conv[:, i]                # (Ll, W-1, C)
    dst.recurrent[:, j] = src.recurrent[:, i]      # (Ll, Hv, dk, dv)
    if src.ple_conv is not None:                   # Qwen4-Exp's PLE layers
        dst.ple_conv[:, j] = src.ple_conv[:, i]    # (Lp, L, C*D)
        dst.ple_ids[j] = src.ple_ids[i]            # (n-1,)


def ple_conv_state_shape(config: Qwen3Config) -> tuple[int, int]:
    """(L, C*D): a PLE convolution's last (K-1) * ngram_size inputs (its dilation is ngram_size), all C streams."""
    return (config.ple_conv_kernel_size - 1) * config.ngram_size, config.hc_count * config.hidden_size


def conv_state_shape(config: Qwen3Config, heads: tuple[int, int] | None = None) -> tuple[int, int]:
    """(W-1, C): the last W-1 inputs of the causal convolution over q, k and v (of `heads`' (Hk, Hv); default all)."""
    Hk, Hv = heads or (config.linear_num_key_heads, config.linear_num_value_heads)
    C = 2 * Hk * config.linear_key_head_dim + Hv * config.linear_value_head_dim
    return config.linear_conv_kernel_dim - 1, C


def recurrent_state_shape(config: Qwen3Config, heads: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(Hv, dk, dv): one (dk, dv) matrix per value head (of `heads`' (Hk, Hv); default all)."""
    Hv = heads[1] if heads else config.linear_num_value_heads
    return Hv, config.linear_key_head_dim, config.linear_value_head_dim


class SequenceCache:
    """One sequence's KV cache for the single-sequence API (`new_cache`, `prefill`, `decode_one_token`):
    a KVCache whose pages hold positions 0 .. capacity - 1 in order."""

    def __init__(self, config: Qwen3Config, capacity: int, xp, dtype, page_size: int = 256,
                 kv_heads: int | None = None, linear_heads: tuple[int, int] | None = None):
        if capacity > config.max_position_embeddings:
            raise NpqwenError(f"a KV cache of {capacity} positions exceeds the model's context of "
                              f"{config.max_position_embeddings} (max_position_embeddings)")
        page_size = max(1, min(page_size, capacity))
        self.kv = KVCache(config, -(-capacity // page_size), page_size, xp, dtype, kv_heads,   # one state slot
                          linear_heads=linear_heads)
        self.page_table = np.arange(self.kv.num_pages)
        self.capacity = capacity
        self.length = 0                                # positions filled so far


@dataclass
class Batch:
    """One packed forward pass: the new tokens of several sequences, back to back.

    Sequence i contributes lengths[i] tokens at positions starts[i] .. starts[i] + lengths[i] - 1;
    its keys and values live in the pages page_tables[i] (page j holds positions j*P .. j*P + P - 1).
    Logits are computed only for the rows in sample_rows. Requests that only read their prompt
    (embeddings, rerank) want other outputs, which forward_batch returns beside the logits
    (model.BatchOutput): the final-norm hidden state of each of hidden_rows, and for each of
    score_rows the logits of just the tokens score_ids names (two rows of lm_head, not the vocabulary).
    """
    token_ids: np.ndarray                 # (T,) int64
    starts: list[int]                     # per sequence: positions already in the cache
    lengths: list[int]                    # per sequence: its new tokens in this batch
    page_tables: list[np.ndarray]         # per sequence: page ids covering positions 0 .. start + length - 1
    page_size: int
    sample_rows: np.ndarray               # rows of token_ids whose logits are wanted
    hidden_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # (R,) rows whose state is wanted
    score_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))    # (Q,) rows scored on a few tokens
    score_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # (Q, k) the tokens of each
    steering: dict = field(default_factory=dict)   # layer -> (T, D) added after that block (npqwen/steering.py)
    feature_edits: dict = field(default_factory=dict)   # layer -> [(FeatureEdit, first row, n rows)] (features.py)
    loras: list = field(default_factory=list)     # per sequence: its LoRA adapter (npqwen/lora.py) or None; [] none
    state_slots: list[int] | None = None  # per sequence: its LinearStates slot (hybrid models); None: 0, 1, 2, ...
    verify: list[bool] | None = None      # per sequence: a speculative verification (its last token and drafts), whose
                                          # linear-attention states after each token are kept (LinearStates.verified)
    positions: np.ndarray = field(init=False)      # (T,) each token's position in its own sequence
    write_pages: np.ndarray = field(init=False)    # (T,) the page each token's keys/values go to
    write_offsets: np.ndarray = field(init=False)  # (T,) ... and the position within that page

    def __post_init__(self):
        self.positions = np.concatenate([np.arange(s, s + n) for s, n in zip(self.starts, self.lengths)])
        self.write_pages = np.concatenate([np.asarray(table)[np.arange(s, s + n) // self.page_size]
                                           for table, s, n in zip(self.page_tables, self.starts, self.lengths)])
        self.write_offsets = self.positions % self.page_size

    @cached_property
    def rows(self):
        """(first row, number of rows) of each sequence."""
        first = np.cumsum([0] + list(self.lengths[:-1]))
        return list(zip(first.tolist(), self.lengths))

    @cached_property
    def output_rows(self) -> np.ndarray:
        """Rows that go through the final norm: sampled, then hidden, then scored ones."""
        return np.concatenate([self.sample_rows, self.hidden_rows, self.score_rows]).astype(np.int64)

    @cached_property
    def decode_rows(self) -> np.ndarray:
        """Rows of the sequences with a single new token (decoding), and below their pages and lengths."""
        return np.array([row for row, n in self.rows if n == 1], dtype=np.int64)

    @cached_property
    def slots(self) -> list[int]:
        """Each sequence's linear-attention state slot."""
        return list(range(len(self.lengths))) if self.state_slots is None else list(self.state_slots)

    @cached_property
    def new_slots(self) -> list[int]:
        """The slots of sequences that start at position 0: their states start from zero."""
        return [slot for slot, start in zip(self.slots, self.starts) if start == 0]

    @cached_property
    def verifying(self) -> list[bool]:
        return [False] * len(self.lengths) if self.verify is None else list(self.verify)

    @cached_property
    def decode_slots(self) -> list[int]:
        return [slot for slot, n in zip(self.slots, self.lengths) if n == 1]

    @cached_property
    def decode_tables(self) -> list:
        return [t for t, n in zip(self.page_tables, self.lengths) if n == 1]

    @cached_property
    def decode_lengths(self) -> list[int]:
        return [s + 1 for s, n in zip(self.starts, self.lengths) if n == 1]
