"""Where keys and values live, and how one forward pass addresses them.

`KVCache` is the storage: every layer's keys and values in pages of P positions. A `Batch` is one
packed forward pass: which tokens run, at which positions, and which pages hold each sequence's
keys and values (its page table). `SequenceCache` is one sequence's pages in order, for the
single-sequence API (`Qwen3.forward`, `prefill`, `decode_one_token`). The engine (npqwen/engine/)
decides what goes into a Batch; the model (npqwen/model.py) only reads and writes what it says.

A hybrid model (Qwen3.5) keeps keys and values for its full-attention layers only; each
linear-attention layer keeps a fixed-size state per sequence instead, in `LinearStates` slots (a
Batch names each sequence's slot). The state does not grow with the context.

Shapes: L layers, N pages, P positions per page, K key/value heads (this rank's), Dh head dim,
T tokens in a batch; Ll linear-attention layers, S state slots, W conv kernel, C convolved channels,
Hv value heads of dv (this rank's), dk key head dim.
"""
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .config import Qwen3Config
from .errors import NpqwenError


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
                 num_slots: int = 1, linear_heads: tuple[int, int] | None = None):
        L, K, Dh = config.num_attention_layers, kv_heads or config.num_key_value_heads, config.head_dim   # K: this rank's
        shape = (L, num_pages, K, page_size, Dh)
        try:
            self.keys = xp.zeros(shape, dtype=dtype)       # (L, N, K, P, Dh)
            self.values = xp.zeros(shape, dtype=dtype)     # (L, N, K, P, Dh)
        except MemoryError as e:   # NumPy's _ArrayMemoryError and CuPy's OutOfMemoryError are both MemoryErrors
            need = 2 * math.prod(shape) * np.dtype(dtype).itemsize
            raise NpqwenError(f"a KV cache of {num_pages} pages x {page_size} positions needs "
                              f"{need / 2**30:.2f} GiB, which cannot be allocated; use fewer pages") from e
        self.num_pages, self.page_size = num_pages, page_size
        self.states = LinearStates(config, num_slots, xp, dtype, linear_heads) if config.hybrid else None
        self.snapshots: LinearStates | None = None   # the engine's snapshots of states, for prefix hits (hybrid)
        self.state_copies: list | None = None        # tensor parallel: rank 0's copies between the two since its
                                                     # last batch, for the other ranks to make (parallel.cache_key)

    def slots(self, pages, offsets):
        """Where token t's key of kv head h goes, as a row of a layer seen as (N*K*P, Dh) rows:
        (T*K,) row numbers for tokens at page pages[t], position offsets[t] within the page."""
        K, P = self.keys.shape[2], self.page_size
        return ((pages[:, None] * K + np.arange(K)) * P + offsets[:, None]).reshape(-1)   # (T*K,), h fastest

    def write(self, layer: int, slots, k, v):
        """Store k, v (T, K, Dh) at their slots: one row copy of Dh values per token and kv head."""
        Dh = k.shape[-1]
        self.keys[layer].reshape(-1, Dh)[slots] = k.reshape(-1, Dh)          # (N*K*P, Dh)[(T*K,)] = (T*K, Dh)
        self.values[layer].reshape(-1, Dh)[slots] = v.reshape(-1, Dh)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + (self.states.nbytes if self.states is not None else 0)

    @staticmethod
    def bytes_per_token(config: Qwen3Config, dtype) -> int:
        """Keys + values of one position in every full-attention layer (all layers of a Qwen3)."""
        return (2 * config.num_attention_layers * config.num_key_value_heads * config.head_dim
                * np.dtype(dtype).itemsize)


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
        # speculative decoding: a verifying sequence's slot -> per linear layer (the conv's inputs (W-1+n, C) from
        # its state on, the delta rule's state after each of its n tokens (n, Hv, dk, dv)), until roll_back
        self.verified: dict[int, dict] = {}

    def roll_back(self, slot: int, kept: int):
        """A verification kept its first `kept` tokens: the slot's states become those after them (the
        convolution's last W-1 inputs up to there, the delta rule's state after token kept - 1)."""
        for layer, (inputs, states) in self.verified.pop(slot, {}).items():   # (none: no linear layer ran)
            W1 = self.conv.shape[2]
            self.conv[layer, slot] = inputs[kept:kept + W1]                  # (W-1, C)
            self.recurrent[layer, slot] = states[kept - 1]                   # (Hv, dk, dv)

    def reset(self, slots):
        """A sequence that starts (position 0) starts from zero states."""
        if len(slots):
            self.conv[:, slots] = 0
            self.recurrent[:, slots] = 0

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    @staticmethod
    def bytes_per_slot(config: Qwen3Config, dtype) -> int:
        """One sequence's states in every linear-attention layer: the same at any context length."""
        Ll = config.num_hidden_layers - config.num_attention_layers
        return Ll * (math.prod(conv_state_shape(config)) * np.dtype(dtype).itemsize
                     + math.prod(recurrent_state_shape(config)) * np.promote_types(dtype, np.float32).itemsize)


def copy_states(src: LinearStates, i: int, dst: LinearStates, j: int):
    """Slot i of src -> slot j of dst, in every linear-attention layer."""
    dst.conv[:, j] = src.conv[:, i]                # (Ll, W-1, C)
    dst.recurrent[:, j] = src.recurrent[:, i]      # (Ll, Hv, dk, dv)


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
