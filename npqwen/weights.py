"""Compact weights: a matrix kept in memory as its file stores it, multiplied a block of rows at a time.

Shapes: a weight is (out, in), the HF layout; x is (T, in); `linear(x)` is x @ W^T, (T, out), in float32.

Decoding one token reads every weight once, so a decode step costs the bytes read from memory
(docs/weights.md). A float32 Qwen3-0.6B reads 2.4 GB per token; the same matrices in bfloat16 are 1.2 GB,
int8 0.6 GB, Q4_K 0.34 GB. Each format below keeps its bytes as stored and widens `block_rows` rows at a
time into one float32 buffer that stays in the core's cache, then one matmul runs on the buffer: the
widening is paid once per block and shared by every row of x (a prefill of 512 tokens, a batch of 64).

    format     stored per value                                   widened by
    bfloat16   uint16: a float32's top 16 bits                     a shift left by 16
    float16    float16                                             a cast
    fp8        float8 e4m3 (uint8) + one scale per 128x128 block   a 256-entry table, times the block's scale
    int8       int8 + one float32 scale per row                    a cast; the scale multiplies the output
    Q8_0 ...   ggml blocks (npqwen/quants.py: llama.cpp's); Q8_0,  quants.dequantize_rows (planes: a cast, the
               Q4_0, Q4_K, Q5_K, Q6_K split at load into planes:   scales per 32); for decoding, products per
               integers (out, in), nibbles (out, in/2) (Q5_K: and   sub-block (sub_block_linear)
               high bits, (out, in/8); Q6_K: and its top two
               bits, (out, in/4)), and scales

Every class has the same few members: `shape`, `nbytes`, `format`, `linear(x)`, `linear_backward(d_y)` (d_y @ W,
the input's gradient through a frozen weight, by the same blocks: QLoRA), `take(ids)` (an embedding lookup that
widens only those rows), `rows(sel)` and `columns(sel)` (a tensor-parallel rank's part), `dequantize()` (the
whole matrix in float32: for tests and inspection, never on the forward path). `Rows` stacks several of them by
rows (q | k | v as qkv_proj, gate | up as gate_up_proj) without a copy. ops.linear, ops.linear_backward and
ops.embed call `linear`, `linear_backward` and `take`; nothing else looks inside.
"""
import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np

from . import quants
from .backend import xp_of
from .errors import NpqwenError

BLOCK_VALUES = 1 << 18   # float32 values of one widened block (1 MiB): it stays in the core's L2 cache
# More than 128 rows of x (a prefill chunk): blocks 8 times larger. The widened block is read by BLAS once
# per tile of x's rows either way, and a wider product runs closer to BLAS's rate (measured, one 3072x1024
# matrix, 512 rows: 0.70x -> 0.78x float32's speed at int8, 0.54x -> 0.66x at Q4_K).
PREFILL_BLOCKS = 8

# what npqwen.load(weights=...) and npqwen quantize convert to (fp8 and Q5_K, Q6_K are read as stored only)
FORMATS = ("bfloat16", "float16", "int8", "q8_0", "q4_0", "q4_k")
GGML = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}   # name -> ggml type


# Threads that widen a ggml matrix's blocks of rows and take their products per sub-block (sub_block_linear) for
# 2 to THREAD_ROWS rows of x (the engine's batched step): as many as OpenBLAS is given (OPENBLAS_NUM_THREADS; by
# default every core). A float32 product of a few rows streams its weights from memory, which a second core speeds
# less; widening is work per value in the core's cache, which a second core halves (measured, docs/weights.md
# section 5: the 32-sequence step at Q8_0 0.69x -> 0.86x float32's speed, both with 2 threads). One row (batch-1
# decode) stays in one thread: split in two it ran no faster (lm_head at Q8_0: 56 -> 53-61 ms; cause not found).
# Up to 32 rows each product there is at most 2^18 multiply-adds (a block's 2^18 values / 32, times 32 rows), which
# OpenBLAS runs in its caller's thread; a larger one it splits across its own threads, and two workers' splits
# wait on each other (measured: int8's 256-row blocks of lm_head, 32 rows, split in two: 0.06x float32's speed).
# 1: no pool, every block in the calling thread.
def widening_threads() -> int:
    """OPENBLAS_NUM_THREADS where it is a positive integer (as OpenBLAS reads it), else the cores this process has."""
    given = os.environ.get("OPENBLAS_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


THREADS = widening_threads()
THREAD_ROWS = 32
_pool = None


def _forget_pool():   # a forked child has none of its parent's threads: it starts a pool of its own
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def in_parts(run, n_out: int, step: int, threads: int):
    """run(a, b) on rows a..b-1 of an (n_out, ...) matrix, split on its blocks of `step` rows into `threads`
    contiguous parts, the first in this thread, the rest in a persistent pool; each part writes its rows only."""
    global _pool
    n_blocks = -(-n_out // step)
    parts = max(1, min(threads, n_blocks))
    cuts = [min(n_blocks * i // parts * step, n_out) for i in range(parts + 1)]   # on block boundaries
    if parts > 1 and _pool is None:
        _pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="npqwen-widen")
    done = [_pool.submit(run, a, b) for a, b in pairwise(cuts[1:])]
    run(cuts[0], cuts[1])
    for f in done:
        f.result()


# OpenBLAS runs a product of 2 to 16 rows of x with a large matrix at about half a single row's speed: it packs the
# whole matrix first, one more pass over memory (or, for a widened block, over the core's cache). So for 2 to
# FEW_ROWS rows of x a matrix is taken a block of its rows a product (small_products): ops.linear's float32 weights
# (few_rows_linear) and the formats widened whole (Compact.linear). With one BLAS thread, each product under
# SMALL_PRODUCT multiply-adds, which OpenBLAS runs unpacked (its small-matrix path); with more, block_rows rows, a
# product OpenBLAS splits across its threads (products under 2^18 it runs in one thread, and Python threads running
# them side by side ran no faster here). Measured, lm_head at the 0.6B width (151,936 x 1,024), float32, one BLAS
# thread, CPU time: 2 rows 93 -> 45 ms, 4 rows 105 -> 52, 8 rows 105 -> 69, 12 rows 122 -> 85, 16 rows 121 -> 103
# (1 row: 43); at 32 rows the blocks ran slower than one product (171 against 155 ms), so FEW_ROWS is 16. Two BLAS
# threads, wall time: 2 rows 73-79 -> 50, 4 rows 88-90 -> 56, 8 rows 84-86 -> 59, 16 rows 87-88 -> 64 (blocks of
# 256 rows; in products under 2^18 split across two Python threads 52 / 55 / 75 / 119). int8 (bfloat16), one
# thread, blocks of 256 widened rows: 2 rows 45 -> 46 ms (64 -> 67), 4 rows 82 -> 57 (104 -> 82), 8 rows 91 -> 76
# (110 -> 94), 16 rows 117 -> 109 (140 -> 126). The ggml formats' products per sub-block are each under 2^18.
FEW_ROWS = 16
SMALL_PRODUCT = 1 << 18


def small_product_rows(w, x) -> int:
    """Rows of w (n, in) per product with x (T, in) in small_products."""
    if THREADS > 1:
        return block_rows(w.shape[1])
    return max(1, (SMALL_PRODUCT - 1) // (w.shape[1] * x.shape[0]))


def small_products(w, x, out):
    """out = w @ x^T, w (n, in), x (T, in) -> out (n, T), a block of w's rows a product (small_product_rows)."""
    step = small_product_rows(w, x)
    for a in range(0, len(w), step):
        np.matmul(w[a:a + step], x.T, out=out[a:a + step])                     # (rows, in) @ (in, T) -> (rows, T)


def block_rows(n_in: int) -> int:
    """Rows widened at a time: a block of about BLOCK_VALUES floats, at least 16 rows."""
    return max(16, BLOCK_VALUES // max(n_in, 1))


def is_compact(weight) -> bool:
    return isinstance(weight, (Compact, Rows))


class Compact:
    """What every format shares: the block loop of linear, take, dequantize. A format says how rows widen:
    widen(rows, out) writes rows `rows` (a slice or an index array) into float32 `out` (n, in) and returns
    None, or a (n,) scale that those rows' outputs are still to be multiplied by."""
    dtype = np.dtype(np.float32)   # of what linear, take and dequantize return
    ndim = 2

    def linear(self, x):
        """x @ W^T: (T, in) -> (T, out). Each block of rows is widened into one reused buffer, then one matmul.
        Up to 128 rows of x (decoding) as (W @ x^T)^T, as ops.linear does for a float32 weight."""
        xp = xp_of(x)
        n_out, n_in = self.shape
        transposed = x.shape[0] <= 128
        step = min(block_rows(n_in) * (1 if transposed else PREFILL_BLOCKS), n_out)
        buf = xp.empty((step, n_in), dtype=np.float32)                      # (rows, in), reused by every block
        y = xp.empty((n_out, x.shape[0]) if transposed else (x.shape[0], n_out), dtype=np.float32)
        for a in range(0, n_out, step):
            b = min(a + step, n_out)
            w = buf[:b - a]
            scale = self.widen(slice(a, b), w)                             # (n, in) float32
            if transposed:
                if 2 <= x.shape[0] <= FEW_ROWS and xp is np:
                    small_products(w, x, y[a:b])                           # (n, in) @ (in, T) -> (n, T), in parts
                else:
                    xp.matmul(w, x.T, out=y[a:b])                          # (n, in) @ (in, T) -> (n, T)
                if scale is not None:
                    y[a:b] *= scale[:, None]
            else:
                xp.matmul(x, w.T, out=y[:, a:b])                           # (T, in) @ (in, n) -> (T, n), into y's columns
                if scale is not None:
                    y[:, a:b] *= scale
        return xp.ascontiguousarray(y.T) if transposed else y

    def linear_backward(self, d_y):
        """d_x = d_y @ W: (T, out) -> (T, in), the gradient of linear's input (a frozen weight: QLoRA). The same
        blocks of rows widened as linear widens them; each adds its rows' share, d_y[:, rows] @ W[rows]."""
        xp = xp_of(d_y)
        n_out, n_in = self.shape
        step = min(block_rows(n_in) * PREFILL_BLOCKS, n_out)
        buf = xp.empty((step, n_in), dtype=np.float32)                      # (rows, in), reused by every block
        d_x = xp.zeros((d_y.shape[0], n_in), dtype=np.float32)              # (T, in)
        for a in range(0, n_out, step):
            b = min(a + step, n_out)
            w = buf[:b - a]
            scale = self.widen(slice(a, b), w)                             # (n, in) float32
            d = d_y[:, a:b] if scale is None else d_y[:, a:b] * scale       # (T, n): a row's scale is on its output
            d_x += d @ w                                                   # (T, n) @ (n, in) -> (T, in)
        return d_x

    def take(self, ids):
        """The rows `ids` (T,) widened to float32 (T, in): an embedding lookup."""
        out = xp_of(self.arrays[0]).empty((len(ids), self.shape[1]), dtype=np.float32)
        scale = self.widen(ids, out)
        if scale is not None:
            out *= scale[:, None]
        return out

    def dequantize(self):
        """The whole matrix in float32 (out, in): for tests and inspection only."""
        return self.take(xp_of(self.arrays[0]).arange(self.shape[0]))

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def __repr__(self):
        return f"{type(self).__name__}(shape={self.shape}, format={self.format!r}, {self.nbytes:,} bytes)"


class BFloat16(Compact):
    """bfloat16 as uint16 bits (out, in): a float32's top 16 bits, widened by a shift."""
    format = "bfloat16"

    def __init__(self, bits):
        self.storage = bits                    # (out, in) uint16; a memory-mapped file's bytes as they are
        self.shape = tuple(bits.shape)

    @property
    def arrays(self):
        return (self.storage,)

    def widen(self, rows, out):
        bf16_bits_to_float32(self.storage[rows], out)

    def rows(self, sel):
        return BFloat16(self.storage[sel])

    def columns(self, sel):
        return BFloat16(xp_of(self.storage).ascontiguousarray(self.storage[:, sel]))


class Float16(Compact):
    """IEEE float16 (out, in), widened by a cast. (Never multiplied in float16 on the CPU: NumPy has no
    float16 BLAS, and its float16 matmul runs 7-19x slower than float32.)"""
    format = "float16"

    def __init__(self, half):
        self.storage = half                    # (out, in) float16
        self.shape = tuple(half.shape)

    @property
    def arrays(self):
        return (self.storage,)

    def widen(self, rows, out):
        out[...] = self.storage[rows]

    def rows(self, sel):
        return Float16(self.storage[sel])

    def columns(self, sel):
        return Float16(xp_of(self.storage).ascontiguousarray(self.storage[:, sel]))


def e4m3_values() -> np.ndarray:
    """The 256 values of float8 e4m3fn (torch.float8_e4m3fn, Qwen's FP8): 1 sign, 4 exponent bits (bias 7),
    3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN, and there is no infinity."""
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    v[(b & 0x7F) == 0x7F] = np.nan
    return np.where(b & 0x80, -v, v).astype(np.float32)


E4M3 = e4m3_values()
FP8_BLOCK = 128   # Qwen's FP8 checkpoints: "weight_block_size": [128, 128]


class FP8(Compact):
    """Qwen's FP8 (`*-FP8` checkpoints): float8 e4m3 bits (out, in) and `weight_scale_inv`, one float per
    128x128 block; W[i, j] = e4m3(bits[i, j]) * scale_inv[i // 128, j // 128]. The scales are kept one row
    per weight row (out, ceil(in / 128)), 1/32 of the weight's bytes, so any rows can be cut."""
    format = "fp8"

    def __init__(self, bits, scale):
        self.storage, self.scale = bits, scale   # (out, in) uint8, (out, ceil(in/128)) float32
        self.shape = tuple(bits.shape)

    @classmethod
    def from_blocks(cls, bits, scale_inv):
        """From the checkpoint's (out, in) bits and (ceil(out/128), ceil(in/128)) block scales."""
        xp = xp_of(bits)
        scale = xp.repeat(xp.asarray(scale_inv, dtype=np.float32), FP8_BLOCK, axis=0)[:bits.shape[0]]
        return cls(bits, xp.ascontiguousarray(scale))

    @property
    def arrays(self):
        return (self.storage, self.scale)

    def widen(self, rows, out):
        xp = xp_of(out)
        xp.take(xp.asarray(E4M3), self.storage[rows], out=out)            # (n, in): the table lookup
        n_in, full = self.shape[1], self.shape[1] // FP8_BLOCK * FP8_BLOCK
        scale = self.scale[rows]                                           # (n, ceil(in/128))
        out[:, :full].reshape(len(out), -1, FP8_BLOCK)[...] *= scale[:, :full // FP8_BLOCK, None]
        if full < n_in:   # a last block narrower than 128 columns
            out[:, full:] *= scale[:, -1:]

    def rows(self, sel):
        return FP8(self.storage[sel], self.scale[sel])

    def columns(self, sel):
        a, b = check_block_columns(self, sel, FP8_BLOCK)
        xp = xp_of(self.storage)
        return FP8(xp.ascontiguousarray(self.storage[:, a:b]),
                   xp.ascontiguousarray(self.scale[:, a // FP8_BLOCK:-(-b // FP8_BLOCK)]))


class Int8(Compact):
    """int8 (out, in) with one float32 scale per row: W[i] = q[i] * scale[i], scale = max|W[i]| / 127.
    The cast is the only widening; the scale multiplies each output value, not the buffer (measured:
    docs/weights.md). One scale per row rather than per 32 columns: Q8_0 is the per-32 form."""
    format = "int8"

    def __init__(self, q, scale):
        self.storage, self.scale = q, scale    # (out, in) int8, (out,) float32
        self.shape = tuple(q.shape)

    @classmethod
    def quantize(cls, w):
        """Round each row of float32 w (out, in) to the nearest of 255 steps of max|row| / 127."""
        xp = xp_of(w)
        scale = (xp.abs(w).max(axis=1) / 127.0).astype(np.float32)        # (out,)
        q = xp.rint(w / xp.where(scale > 0, scale, 1.0)[:, None])
        return cls(xp.clip(q, -127, 127).astype(np.int8), scale)

    @property
    def arrays(self):
        return (self.storage, self.scale)

    def widen(self, rows, out):
        # the rows copied first, then cast from the copy in cache: NumPy's cast reads memory slower than a copy
        # does (measured: decode 0.87x -> 1.0x float32's speed, the 0.6B matrices, one BLAS thread)
        xp_of(out).copyto(out, self.storage[rows].copy(), casting="unsafe")   # int8 -> float32
        return self.scale[rows]

    def rows(self, sel):
        return Int8(self.storage[sel], self.scale[sel])

    def columns(self, sel):
        return Int8(xp_of(self.storage).ascontiguousarray(self.storage[:, sel]), self.scale)


class Ggml(Compact):
    """llama.cpp's block formats (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, ...): each row is in/block_size blocks of
    type_size bytes, widened by quants.dequantize_rows, which spells out each format's block (npqwen/quants.py).
    Q8_0, Q4_0, Q4_K, Q5_K and Q6_K are split once, when the weight is made, into their planes (PLANES): the
    integers of every block side by side, (out, in) int8 or (out, in/2) packed nibbles (Q5_K: and its high bits,
    (out, in/8); Q6_K: and its top two bits, (out, in/4), one (out, 3 in/4) array), and the scales, (in/32, out)
    each (Q6_K's sub-blocks: in/16):
    the same integers and scales, but a block of rows widens by one contiguous cast, several times faster than
    a cast through the 34-, 18- or 144-byte blocks (measured: docs/weights.md section 5), in fewer bytes (no
    float16 scale kept beside its float32). `storage` gives the file's blocks back, bit for bit (for saving)."""

    def __init__(self, qtype: str, raw, n_in: int, planes=None):
        block, size = quants.BLOCKS[qtype]
        if planes is None and (n_in % block or raw.shape[1] != n_in // block * size):
            raise NpqwenError(f"a {qtype} matrix of {n_in} columns needs {n_in // block * size} bytes per row "
                              f"(blocks of {block} values in {size} bytes), got {raw.shape[1]}")
        self.format = qtype
        if planes is None and qtype in PLANES:
            planes = split_released(qtype, raw)
        self.planes, self.raw = planes, (None if planes else raw)   # raw: (out, in/block * size) uint8
        self.shape = (len(planes[0]) if planes else raw.shape[0], n_in)
        # the sub-blocks' scale fields, decoded once for the products per sub-block (sub_block_linear)
        if planes:
            self.fields = planes[1:]
        else:
            self.fields = AFFINE[qtype][1](raw) if qtype in AFFINE and xp_of(raw) is np else ()

    @classmethod
    def quantize(cls, qtype: str, w, threads: int = 1):
        """float32 rows w (out, in) as llama.cpp's quantizer writes them, `threads` parts of the rows at once
        (in_parts; numpy lets go of the GIL in each pass over a chunk): each block is quantized alone, so the
        bytes do not depend on the parts."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        raw = np.empty((w.shape[0], quants.row_bytes(qtype, w.shape[1])), np.uint8)

        def run(a, b):
            raw[a:b] = quants.quantize_rows(qtype, w[a:b])
        in_parts(run, w.shape[0], 1, threads)
        return cls(qtype, raw, w.shape[1])

    @property
    def storage(self):
        """The blocks as the file stores them (out, in/block * size) uint8 (planes: interleaved again, a copy)."""
        return self.raw if self.planes is None else PLANES[self.format][1](*self.planes)

    @property
    def arrays(self):
        return self.planes or (self.raw,)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays) + (0 if self.planes else sum(int(f.nbytes) for f in self.fields))

    def widen(self, rows, out):
        if self.planes:
            PLANES[self.format][2](self.planes[0][rows], *(f[:, rows] for f in self.planes[1:]), out)
        else:
            quants.dequantize_rows(self.format, self.raw[rows], out)

    def linear(self, x):
        """x @ W^T. A few rows of x: sub_block_linear, which widens the integers only and applies the scales
        to the products; more rows, or no fields (F16, BF16, F32, arrays on a GPU): Compact's
        widen-then-matmul on quants.py's rule for each block, the reference."""
        few = 1 if self.format == "Q6_K" else BLOCK_DOT_ROWS   # Q6_K: see BLOCK_DOT_ROWS
        if x.shape[0] > few or not self.fields or xp_of(self.arrays[0]) is not np:
            return Compact.linear(self, x)
        return sub_block_linear(x, self)

    def rows(self, sel):
        if self.planes:   # copies of those rows: a view would keep the whole matrix's planes (a TP rank's memory)
            xp = xp_of(self.planes[0])
            return Ggml(self.format, None, self.shape[1], (xp.ascontiguousarray(self.planes[0][sel]),
                                                           *(xp.ascontiguousarray(f[:, sel]) for f in self.planes[1:])))
        return Ggml(self.format, self.raw[sel], self.shape[1])

    def columns(self, sel):
        block, size = quants.BLOCKS[self.format]
        a, b = check_block_columns(self, sel, block)
        part = self.storage[:, a // block * size:b // block * size]   # the blocks (planes: split again)
        return Ggml(self.format, xp_of(part).ascontiguousarray(part), b - a)


# ---------------------------------------------------------------- Q8_0, Q4_0, Q4_K and Q6_K as planes
# block_q8_0 is f16 d | int8 q[32]; block_q4_0 is f16 d | uint8 qs[16] (value j the low nibble of qs[j], value
# j + 16 the high one, each minus 8). Each format: `split` (the file's blocks -> the planes), `join` (back),
# `widen` (a block of rows' planes -> float32 out (n, in): w = d * q). Under the array-module shim (CuPy too).
# Q4_0's nibbles are paired anew across the row, not the block: byte j of a row holds value j in its low nibble
# and value j + in/2 in its high one, so that unpacking is two passes over whole rows, each writing one half of
# the row in order (pairs within a 16-byte block made each pass run 16 values at a time: 3x slower). Q4_K's
# nibbles likewise, its sub-blocks' 6-bit scales and mins a byte each; Q6_K's low nibbles likewise, their top two
# bits four to a byte, paired across the row in quarters (split_q6_k).

def split_q8_0(raw):
    """(n, nb*34) blocks -> q (n, nb*32) int8, d (nb, n) float32."""
    xp, n = xp_of(raw), len(raw)
    b = raw.reshape(n, -1, 34)                                                 # (n, nb, 34)
    q = xp.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1)          # (n, nb*32)
    d = xp.ascontiguousarray(b[..., :2]).view(np.float16).reshape(n, -1)       # (n, nb)
    return q, xp.ascontiguousarray(d.T, dtype=np.float32)


def join_q8_0(q, d):
    xp, n = xp_of(q), len(q)
    b = xp.empty((n, d.shape[0], 34), dtype=np.uint8)                          # (n, nb, 34)
    b[..., :2] = d.T.astype(np.float16)[..., None].view(np.uint8)              # exact: d came from float16
    b[..., 2:] = q.reshape(n, -1, 32).view(np.uint8)
    return b.reshape(n, -1)


def widen_q8_0(q, d, out):
    xp, n = xp_of(out), len(out)
    xp.multiply(q.reshape(n, -1, 32), d.T[..., None], out=out.reshape(n, -1, 32), casting="unsafe")


def split_q4_0(raw):
    """(n, nb*18) blocks -> qs (n, in/2) uint8 (byte j: value j | value j + in/2 << 4), d (nb, n) float32."""
    xp, n = xp_of(raw), len(raw)
    b = raw.reshape(n, -1, 18)
    half = b.shape[1] * 16
    qs = xp.empty((n, half), dtype=np.uint8)
    for a in range(0, n, 4096):   # a few rows at a time: the unpacked values are a byte each
        p = b[a:a + 4096, :, 2:]                                               # (rows, nb, 16)
        v = xp.concatenate([p & 0x0F, p >> 4], axis=2).reshape(len(p), -1)     # (rows, in): 0..15, in order
        qs[a:a + 4096] = v[:, :half] | (v[:, half:] << 4)
    d = xp.ascontiguousarray(b[..., :2]).view(np.float16).reshape(n, -1)
    return qs, xp.ascontiguousarray(d.T, dtype=np.float32)


def unpack_q4_0(qs, out):
    """The values 0..15 of rows qs (n, in/2) into `out` (n, in), in order."""
    half = qs.shape[1]
    xp_of(out).bitwise_and(qs, 0x0F, out=out[:, :half], casting="unsafe")
    xp_of(out).right_shift(qs, 4, out=out[:, half:], casting="unsafe")


def join_q4_0(qs, d):
    xp, n = xp_of(qs), len(qs)
    v = xp.empty((n, 2 * qs.shape[1]), dtype=np.uint8)
    unpack_q4_0(qs, v)
    v = v.reshape(n, -1, 32)                                                   # (n, nb, 32)
    b = xp.empty((n, d.shape[0], 18), dtype=np.uint8)
    b[..., :2] = d.T.astype(np.float16)[..., None].view(np.uint8)
    b[..., 2:] = v[..., :16] | (v[..., 16:] << 4)
    return b.reshape(n, -1)


def widen_q4_0(qs, d, out):
    n = len(out)
    unpack_q4_0(qs, out)
    out3 = out.reshape(n, -1, 32)
    out3 -= 8
    out3 *= d.T[..., None]


def split_q4_k(raw):
    """(n, nb*144) blocks -> qs (n, in/2) uint8 paired as Q4_0's, d, dmin (nb, n) float32, the 6-bit scales and
    mins (quants.k_scale_min) sc, m (nb*8, n) uint8: w = d*sc_s * q - dmin*m_s in sub-block s of 32."""
    xp, n = xp_of(raw), len(raw)
    b = raw.reshape(n, -1, 144)
    half = b.shape[1] * 128
    qs = xp.empty((n, half), dtype=np.uint8)
    for a in range(0, n, 4096):   # a few rows at a time: the unpacked values are a byte each
        p = b[a:a + 4096, :, 16:].reshape(-1, b.shape[1], 4, 1, 32)           # (rows, nb, 4, 1, 32)
        v = xp.concatenate([p & 0x0F, p >> 4], axis=3).reshape(len(p), -1)     # (rows, in): sub-blocks 2j, 2j+1
        qs[a:a + 4096] = v[:, :half] | (v[:, half:] << 4)
    sc, m = quants.k_scale_min(b[..., 4:16].reshape(-1, 12))                  # (n*nb, 8) each
    d, dmin = (xp.ascontiguousarray(b[..., k:k + 2]).view(np.float16).reshape(n, -1) for k in (0, 2))
    return (qs, *(xp.ascontiguousarray(f.T, dtype=np.float32) for f in (d, dmin)),
            *(xp.ascontiguousarray(f.reshape(n, -1).T) for f in (sc, m)))


def join_q4_k(qs, d, dmin, sc, m):
    xp, n = xp_of(qs), len(qs)
    v = xp.empty((n, 2 * qs.shape[1]), dtype=np.uint8)
    unpack_q4_0(qs, v)
    v = v.reshape(n, -1, 4, 2, 32)                                             # (n, nb, 4, low | high, 32)
    sc, m = sc.T.reshape(n, -1, 8), m.T.reshape(n, -1, 8)                      # (n, nb, 8)
    b = xp.empty((n, d.shape[0], 144), dtype=np.uint8)
    b[..., 0:2] = d.T.astype(np.float16)[..., None].view(np.uint8)
    b[..., 2:4] = dmin.T.astype(np.float16)[..., None].view(np.uint8)
    b[..., 4:8] = sc[..., :4] | (sc[..., 4:] >> 4) << 6                       # quants.k_scale_min, undone
    b[..., 8:12] = m[..., :4] | (m[..., 4:] >> 4) << 6
    b[..., 12:16] = (sc[..., 4:] & 0x0F) | (m[..., 4:] & 0x0F) << 4
    b[..., 16:] = (v[..., 0, :] | v[..., 1, :] << 4).reshape(n, -1, 128)
    return b.reshape(n, -1)


def widen_q4_k(qs, d, dmin, sc, m, out):
    unpack_q4_0(qs, out)
    scale_k_rows(out, d, dmin, sc, m)


def scale_k_rows(out, d, dmin, sc, m):
    """Q4_K's and Q5_K's rule on a block of rows whose integers q are widened in out (n, in): w = d*sc_s * q -
    dmin*m_s in each sub-block s of 32, in place."""
    scale, low = q4_k_scales(d, dmin, sc, m)                                   # (nb*8, n) each
    out3 = out.reshape(len(out), -1, 32)
    out3 *= scale.T[..., None]
    out3 -= low.T[..., None]


def q6_k_values(raw):
    """The 6-bit values 0..63 of Q6_K blocks raw (n, nb*210) in order, (n, in) uint8. block_q6_K is ql[128] |
    qh[64] | int8 scales[16] | f16 d; each half of 128 values takes 64 bytes of ql and 32 of qh: values v, v+32,
    v+64, v+96 (v < 32) take the low nibble of ql[v], of ql[v+32], the high nibble of ql[v], of ql[v+32], and bits
    0-1, 2-3, 4-5, 6-7 of qh[v] as their top two bits."""
    xp, n = xp_of(raw), len(raw)
    b = raw.reshape(n, -1, 210)
    ql, qh = b[..., :128].reshape(n, -1, 2, 2, 32), b[..., 128:192].reshape(n, -1, 2, 1, 32)
    v = xp.concatenate([ql & 0x0F, ql >> 4], axis=3)                           # (n, nb, half, 4, 32): low, high
    v |= ((qh >> xp.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3) << 4   # the top two bits: 0..63
    return v.reshape(n, -1)


def split_q6_k(raw):
    """(n, nb*210) blocks -> qs (n, 3 in/4) uint8: the low nibbles paired as Q4_0's (in/2 bytes), then the top
    two bits four to a byte (byte j of the in/4: values j, j + in/4, j + in/2, j + 3 in/4 in bits 0-1, 2-3, 4-5,
    6-7); d (nb, n) float32 and sc (nb*16, n) int8: w = d*sc_j * (q - 32) in sub-block j of 16."""
    xp, n = xp_of(raw), len(raw)
    b = raw.reshape(n, -1, 210)
    half, quarter = b.shape[1] * 128, b.shape[1] * 64
    qs = xp.empty((n, 3 * quarter), dtype=np.uint8)
    for a in range(0, n, 4096):   # a few rows at a time: the values are a byte each
        v = q6_k_values(raw[a:a + 4096])                                       # (rows, in) 0..63
        qs[a:a + 4096, :half] = (v[:, :half] & 0x0F) | (v[:, half:] & 0x0F) << 4
        top = v >> 4                                                           # (rows, in) 0..3
        qs[a:a + 4096, half:] = (top[:, :quarter] | top[:, quarter:half] << 2 | top[:, half:3 * quarter] << 4
                                 | top[:, 3 * quarter:] << 6)
    d = xp.ascontiguousarray(b[..., 208:210]).view(np.float16).reshape(n, -1)  # (n, nb)
    sc = b[..., 192:208].view(np.int8).reshape(n, -1)                          # (n, nb*16)
    return qs, xp.ascontiguousarray(d.T, dtype=np.float32), xp.ascontiguousarray(sc.T)


def unpack_q6_k(qs, out):
    """The values 0..63 of rows qs (n, 3 in/4) into uint8 `out` (n, in), in order. Shifted as 8-byte words (NumPy
    shifts bytes one at a time but words 8 bytes at once); a mask per byte drops the bits a shift carries across
    bytes (measured, a 256 x 1024 block: 157 us as bytes, 78 us as words)."""
    xp, quarter = xp_of(out), qs.shape[1] // 3
    low = xp.ascontiguousarray(qs[:, :2 * quarter]).view(np.uint64)           # (n, in/16): the nibbles, 8 bytes a word
    top = xp.ascontiguousarray(qs[:, 2 * quarter:]).view(np.uint64)           # (n, in/32): the 2-bit fields
    w, half = out.view(np.uint64), low.shape[1]                                # (n, in/8)
    nibble, field = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x3030303030303030)   # bits 0-3, bits 4-5 of each byte
    xp.bitwise_and(low, nibble, out=w[:, :half])                               # values j < in/2: low nibbles
    xp.bitwise_and(low >> np.uint64(4), nibble, out=w[:, half:])               # values j + in/2: high nibbles
    for k in range(4):                                                         # quarter k: bits 2k, 2k+1 moved to 4, 5
        moved = top << np.uint64(4 - 2 * k) if k < 2 else top >> np.uint64(2 * k - 4)
        w[:, k * half // 2:(k + 1) * half // 2] |= xp.bitwise_and(moved, field, out=moved)
    return out


def join_q6_k(qs, d, sc):
    xp, n = xp_of(qs), len(qs)
    v = unpack_q6_k(qs, xp.empty((n, 4 * (qs.shape[1] // 3)), dtype=np.uint8)).reshape(n, -1, 2, 4, 32)
    b = xp.empty((n, d.shape[0], 210), dtype=np.uint8)
    b[..., :128] = ((v[..., :2, :] & 0x0F) | (v[..., 2:, :] & 0x0F) << 4).reshape(n, -1, 128)   # q6_k_values, undone
    b[..., 128:192] = sum((v[..., k, :] >> 4) << 2 * k for k in range(4)).reshape(n, -1, 64)
    b[..., 192:208] = sc.T.reshape(n, -1, 16).view(np.uint8)
    b[..., 208:210] = d.T.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(n, -1)


def widen_q6_k(qs, d, sc, out):
    xp, n = xp_of(out), len(out)
    q = unpack_q6_k(qs, xp.empty(out.shape, dtype=np.uint8))
    q -= 32                                                                    # as int8: q - 32
    xp.copyto(out, q.view(np.int8), casting="unsafe")
    out.reshape(n, -1, 16)[...] *= q6_k_scales(d, sc)[0].T[..., None]         # (n, nb*16, 16) * (n, nb*16, 1)


# Q5_K is Q4_K with a fifth, high bit per value (block_q5_K: f16 d | f16 dmin | scales[12] | qh[32] | qs[128]; bit
# j of qh[l] is the high bit of value l of sub-block j). Its planes are Q4_K's, the nibbles paired across the row,
# and one more: the high bits packed eight values to a byte in the row's order (bit b of byte i: value 8i + b),
# which `unpackbits` widens in one pass. Both integer planes are one array, (out, in/2 + in/8) uint8, the nibbles
# then the bits, so that a block of rows is one slice. The high bits are added as 16 * bit on uint64 views of
# the bytes (8 values at a time: NumPy's uint8 shift and or ran 3.5x slower than the same on uint64).

def split_q5_k(raw):
    """(n, nb*176) blocks -> q (n, in/2 + in/8) uint8 (Q4_K's nibbles, then the high bits), d, dmin (nb, n)
    float32, sc, m (nb*8, n) uint8: w = d*sc_s * q - dmin*m_s in sub-block s of 32, q = nibble + 16 * high bit."""
    xp, n = xp_of(raw), len(raw)
    b = raw.reshape(n, -1, 176)
    nb = b.shape[1]
    half = nb * 128
    q = xp.empty((n, half + nb * 32), dtype=np.uint8)
    d, dmin = xp.empty((nb, n), dtype=np.float32), xp.empty((nb, n), dtype=np.float32)
    sc, m = xp.empty((nb * 8, n), dtype=np.uint8), xp.empty((nb * 8, n), dtype=np.uint8)
    for a in range(0, n, 4096):   # a few rows at a time: the unpacked bits are a byte each
        p, rows = b[a:a + 4096], slice(a, a + 4096)
        q4_k = xp.concatenate([p[..., :16], p[..., 48:]], axis=2).reshape(len(p), -1)   # the same block less qh
        q[rows, :half], d[:, rows], dmin[:, rows], sc[:, rows], m[:, rows] = split_q4_k(q4_k)
        high = xp.unpackbits(xp.ascontiguousarray(p[..., 16:48]).reshape(-1), bitorder="little")   # qh[l] bit j
        high = high.reshape(len(p), nb, 32, 8).transpose(0, 1, 3, 2)          # (rows, nb, j, l): values in order
        q[rows, half:] = xp.packbits(high.reshape(-1), bitorder="little").reshape(len(p), -1)
    return q, d, dmin, sc, m


def join_q5_k(q, d, dmin, sc, m):
    xp, n = xp_of(q), len(q)
    half = q.shape[1] * 4 // 5
    q4_k = join_q4_k(xp.ascontiguousarray(q[:, :half]), d, dmin, sc, m).reshape(n, -1, 144)
    high = xp.unpackbits(xp.ascontiguousarray(q[:, half:]).reshape(-1), bitorder="little")   # values in order
    high = high.reshape(n, -1, 8, 32).transpose(0, 1, 3, 2)                   # (n, nb, l, j)
    b = xp.empty((n, q4_k.shape[1], 176), dtype=np.uint8)
    b[..., :16], b[..., 48:] = q4_k[..., :16], q4_k[..., 16:]
    b[..., 16:48] = xp.packbits(xp.ascontiguousarray(high).reshape(-1), bitorder="little").reshape(n, -1, 32)
    return b.reshape(n, -1)


def unpack_q5_k(q, out):
    """The values 0..31 of rows q (n, in/2 + in/8) into uint8 `out` (n, in), contiguous, in order."""
    xp = xp_of(out)
    half = out.shape[1] // 2
    unpack_q4_0(q[:, :half], out)                                              # the low 4 bits
    high = xp.unpackbits(xp.ascontiguousarray(q[:, half:]).reshape(-1), bitorder="little").view(np.uint64)
    high <<= np.uint64(4)                                                      # 0 or 16 in each byte
    wide = out.reshape(-1).view(np.uint64)
    wide |= high


def widen_q5_k(q, d, dmin, sc, m, out):
    values = xp_of(out).empty(out.shape, dtype=np.uint8)
    unpack_q5_k(q, values)
    xp_of(out).copyto(out, values, casting="unsafe")
    scale_k_rows(out, d, dmin, sc, m)


PLANES = {"Q8_0": (split_q8_0, join_q8_0, widen_q8_0), "Q4_0": (split_q4_0, join_q4_0, widen_q4_0),
          "Q4_K": (split_q4_k, join_q4_k, widen_q4_k), "Q5_K": (split_q5_k, join_q5_k, widen_q5_k),
          "Q6_K": (split_q6_k, join_q6_k, widen_q6_k)}


def release(raw):
    """Drop the pages of a memory-mapped `raw` from this process once it is split into planes: read once, they
    would otherwise stay counted in the process's memory (RSS) beside the planes. The file's bytes stay in the
    system's file cache and are read again if anything views them."""
    base = raw
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED"):   # (Linux, macOS)
        return
    page = mmap.PAGESIZE
    start = raw.__array_interface__["data"][0]
    a, b = start // page * page, -(-(start + raw.nbytes) // page) * page   # the whole pages around raw
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), mmap.MADV_DONTNEED)


def split_released(qtype: str, raw, rows: int = 4096):
    """PLANES[qtype]'s split of raw (out, row bytes) `rows` rows at a time into planes made once, each run of the
    file's rows released as soon as it is split: while loading, the process holds the planes and one run of the
    file's bytes, not a whole matrix twice (Qwen3-8B's lm_head at Q8_0: 0.66 GB of blocks beside its planes)."""
    split = PLANES[qtype][0]
    if len(raw) <= rows:
        planes = split(raw)
        release(raw)
        return planes
    xp, n, first = xp_of(raw), len(raw), split(raw[:rows])
    planes = (xp.empty((n, *first[0].shape[1:]), dtype=first[0].dtype),     # the integers, a row per row
              *(xp.empty((len(f), n), dtype=f.dtype) for f in first[1:]))   # the scales, a column per row
    for a in range(0, n, rows):
        part = first if a == 0 else split(raw[a:a + rows])
        planes[0][a:a + rows] = part[0]
        for plane, f in zip(planes[1:], part[1:]):
            plane[:, a:a + rows] = f
        release(raw[a:a + rows])
    return planes


# ---------------------------------------------------------------- ggml blocks: products per sub-block
# Every ggml format npqwen reads is affine in each sub-block s of S values (S = 32; 16 for Q6_K):
#     w = scale_s * q - low_s,   q a small integer packed in the block's bytes,
# so  x . w_r = sum_s scale_rs * (q_rs . x_s) - sum_s low_rs * sum(x_s).
# Scaling a widened buffer 32 values at a time costs NumPy a call per 32 values, several times the matmul
# itself. So for a few rows of x (decoding, the engine's step: BLOCK_DOT_ROWS) only the integers q are widened
# (`ints`, per format), one batched matmul over the buffer's sub-blocks gives every product (q_rs . x_s), and
# the scales and lows are applied to those, S times fewer values than the weights. More rows (a prefill chunk)
# share one widening: Compact.linear on quants.dequantize_rows, the formats' reference rule (measured: faster
# there than widening the integers and scaling the buffer, 0.78x against 0.70x float32's speed at Q8_0, 512
# rows). tests/test_weights.py checks the products against the reference at every format.
BLOCK_DOT_ROWS = 64   # Q6_K: one row only. Its 16-value sub-blocks make twice the products, and at 32 rows
                      # widening once ran faster (0.25x against 0.19x float32's speed); with sub_block_rows both
                      # run at 0.53x, the products 3-10% faster at 4 to 16 rows, 3% slower at 2 (kept at one).


# Each format in three small functions: `fields`, its blocks' scale fields decoded once when the weight is made
# (kept beside the blocks as Ggml.fields, 4-6 bytes per 32 values; for planes, the scale planes); `scales`, those
# fields -> float32 (ns, n) scales and lows (or None) for a block of rows; `ints`, the integers q of a block of
# rows (their blocks, or their integer plane's rows) written into float32 `out` (n, ns, S), Q6_K's through
# `scratch`, a reused uint8 (n, ns, S). The rules are
# quants.dequantize_q8_0 / _q4_0 / _q4_k / _q6_k's; how each unpacks is what measured fastest (a NumPy pass
# over whole rows beats one whose inner loop is 16 values, not always one of 32; Q4's nibbles unpacked straight
# into float32 beat unpacking into uint8 then casting: decode 0.63x -> 0.70x float32's speed at Q4_0).

# Q8_0, Q4_0, Q4_K, Q5_K and Q6_K are kept as planes (PLANES): their fields are the scale planes (d; Q4_K's and
# Q5_K's d, dmin, sc, m; Q6_K's d, sc), and `ints` takes the integer plane's rows, one contiguous run each (Q4_K's
# nibbles as Q4_0's; Q5_K's nibbles, then its high bits; Q6_K's nibbles, then its top bits).

def q8_0_scales(d):
    return d, None


def q8_0_ints(q, out, scratch):
    np.copyto(out, q.copy().reshape(out.shape), casting="unsafe")             # (n, nb*32) int8 -> (n, nb, 32), as Int8's


def q4_0_scales(d):
    return d, 8 * d


def q4_0_ints(qs, out, scratch):
    unpack_q4_0(qs, out.reshape(len(qs), -1))                                  # (n, in) float32, in order


def q4_k_scales(d, dmin, sc, m):
    n = d.shape[1]
    scale = d[:, None] * sc.reshape(-1, 8, n)                               # (nb, 8, n)
    low = dmin[:, None] * m.reshape(-1, 8, n)
    return scale.reshape(-1, n), low.reshape(-1, n)                         # (nb*8, n)


def q6_k_scales(d, sc):
    n = d.shape[1]
    scale = (d[:, None] * sc.reshape(-1, 16, n)).reshape(-1, n)              # (nb*16, n)
    return scale, 32 * scale


def q6_k_ints(qs, out, scratch):
    unpack_q6_k(qs, scratch.reshape(len(qs), -1))                              # (n, in) uint8 0..63, in order
    np.copyto(out, scratch, casting="unsafe")


def q5_k_ints(q, out, scratch):
    unpack_q5_k(q, scratch.reshape(len(q), -1))                                # (n, in) uint8, in order
    np.copyto(out, scratch, casting="unsafe")


# qtype -> (S, fields, scales, ints)
AFFINE = {"Q8_0": (32, None, q8_0_scales, q8_0_ints),          # fields: the planes' scales (PLANES)
          "Q4_0": (32, None, q4_0_scales, q4_0_ints),
          "Q4_K": (32, None, q4_k_scales, q4_0_ints),
          "Q5_K": (32, None, q4_k_scales, q5_k_ints),
          "Q6_K": (16, None, q6_k_scales, q6_k_ints)}


def sub_block_linear(x, w: "Ggml"):
    """x @ W^T for a few rows x (T, in) -> (T, out), from the integers and the sub-blocks' scales."""
    T, (n_out, n_in) = x.shape[0], w.shape
    S, _, scales, ints = AFFINE[w.format]
    ns = n_in // S                                                             # sub-blocks per row
    xb = x.reshape(T, ns, S)                                                   # (T, ns, S)
    sums = xb.sum(axis=2)                                                      # (T, ns): sum(x_s)
    xs = np.ascontiguousarray(xb.transpose(1, 2, 0))                           # (ns, S, T)
    step = min(sub_block_rows(n_in, ns, T), n_out)
    y = np.empty((n_out, 1, T), dtype=np.float32)

    def run(start, stop):                                                      # rows start..stop-1 of y
        buf = np.empty((step, ns, S), dtype=np.float32)                        # (rows, ns, S), reused
        scratch = np.empty((step, ns, S), dtype=np.uint8)                      # unpacked nibbles, reused
        for a in range(start, stop, step):
            b = min(a + step, stop)
            q = buf[:b - a]                                                    # (n, ns, S)
            ints(w.arrays[0][a:b], q, scratch[:b - a])
            scale, low = scales(*(f[:, a:b] for f in w.fields))               # (ns, n) float32 each, low or None
            dots = np.matmul(q.transpose(1, 0, 2), xs)                         # (ns, n, S) @ (ns, S, T) -> (ns, n, T)
            # sum_s scale * (q . x_s), a (1, ns) @ (ns, T) product per row (an einsum ran 2.5x slower at T=32)
            np.matmul(scale.T[:, None, :], dots.transpose(1, 0, 2), out=y[a:b])   # (n, 1, ns) @ (n, ns, T) -> (n, 1, T)
            if low is not None:
                y[a:b, 0] -= low.T @ sums.T                                    # (n, ns) @ (ns, T): sum_s low * sum(x_s)

    in_parts(run, n_out, step, THREADS if 1 < T <= THREAD_ROWS else 1)
    return np.ascontiguousarray(y[:, 0].T)


def sub_block_rows(n_in: int, ns: int, T: int) -> int:
    """Rows of W per block in sub_block_linear: the widened rows (n, in) and their products (ns, n, T) together
    about BLOCK_VALUES floats, in the core's L2 cache (measured, lm_head at the 0.6B width, 32 rows of x: 256 rows
    a block, the products as large as the rows, ran Q4_K at 0.79-0.85x float32's speed, 128 rows at 0.88-0.93x)."""
    return max(16, BLOCK_VALUES // (n_in + ns * T))


def check_block_columns(weight, sel: slice, block: int) -> tuple[int, int]:
    """A column range that starts and ends on the format's block boundaries (a tensor-parallel rank's part)."""
    a, b, _ = sel.indices(weight.shape[1])
    if a % block or (b % block and b != weight.shape[1]):
        raise NpqwenError(f"a {weight.format} matrix {weight.shape} is stored in blocks of {block} columns, so a "
                          f"tensor-parallel rank cannot take columns {a}..{b}; use a tensor-parallel size that "
                          f"splits it on whole blocks, or another --weights format")
    return a, b


class Rows:
    """Compact matrices stacked by rows, without a copy: qkv_proj is q_proj | k_proj | v_proj, gate_up_proj is
    gate_proj | up_proj. The HF-named entries are the parts themselves."""
    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def linear(self, x):
        """x @ [W_1; W_2; ...]^T = [x @ W_1^T, x @ W_2^T, ...]: (T, in) -> (T, out). More than 128 rows of x (a
        prefill chunk): Compact's block loop over the stacked rows, a block widened across the parts' boundaries,
        as one matrix, as few products as a fused float32 matrix makes (measured, 512 rows of int8, CPU time:
        qkv_proj 0.81x -> 0.83x float32's fused product, the 4-layer prefill's products 0.83x -> 0.87x)."""
        if x.shape[0] > 128:
            return Compact.linear(self, x)
        return xp_of(x).concatenate([p.linear(x) for p in self.parts], axis=1)

    def widen(self, rows: slice, out):
        """Stacked rows a..b into float32 out (b - a, in), each part widening its share; their row scales (int8's,
        ones for a part that has none), or None if no part has any."""
        xp, scales, start = xp_of(out), [], 0
        for p in self.parts:
            a, b = max(rows.start - start, 0), min(rows.stop - start, p.shape[0])   # this part's rows in the block
            if a < b:
                scales.append((b - a, p.widen(slice(a, b), out[start + a - rows.start:start + b - rows.start])))
            start += p.shape[0]
        if all(scale is None for _, scale in scales):
            return None
        return xp.concatenate([xp.ones(n, dtype=np.float32) if scale is None else scale for n, scale in scales])

    def linear_backward(self, d_y):
        """d_y @ [W_1; W_2; ...] = sum of d_y's columns of each part @ that part: (T, out) -> (T, in)."""
        ends = np.cumsum([p.shape[0] for p in self.parts])
        return sum(p.linear_backward(d_y[:, e - p.shape[0]:e]) for p, e in zip(self.parts, ends))

    def dequantize(self):
        return xp_of(self.parts[0].arrays[0]).concatenate([p.dequantize() for p in self.parts])

    @property
    def format(self) -> str:
        return "+".join(dict.fromkeys(p.format for p in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __repr__(self):
        return f"Rows(shape={self.shape}, format={self.format!r}, {len(self.parts)} parts)"


def as_array(weight):
    """A weight as a float32 array (dequantized if compact): for tests, inspection, lens's per-head shares."""
    return weight.dequantize() if is_compact(weight) else weight


def bf16_bits_to_float32(bits, out):
    """Widen bfloat16 bit patterns (uint16) into float32 `out`: bf16 is a float32's top 16 bits."""
    xp = xp_of(out)
    if out.dtype == xp.float32:
        wide = out.view(xp.uint32)   # write in place, no temporary
        wide[...] = bits
        wide <<= 16
    else:
        out[...] = (bits.astype(xp.uint32) << 16).view(xp.float32)


def float32_to_bf16_bits(a) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even, as torch does) and return the uint16 bits."""
    xp = xp_of(a)
    bits = xp.ascontiguousarray(a, dtype=np.float32).view(xp.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def quantize(w, fmt: str, threads: int = 1):
    """float32 rows w (n, in) in format `fmt` (one of FORMATS); ggml blocks quantized by `threads` threads."""
    if fmt == "bfloat16":
        return BFloat16(float32_to_bf16_bits(w))
    if fmt == "float16":
        return Float16(w.astype(np.float16))
    if fmt == "int8":
        return Int8.quantize(w)
    if fmt in GGML:
        return Ggml.quantize(GGML[fmt], w, threads)
    raise NpqwenError(f"cannot quantize to {fmt!r}; use one of bfloat16, float16, int8, {', '.join(GGML)}")


def join_rows(pieces: list):
    """One compact matrix from pieces of consecutive rows in one format (quantized a chunk at a time)."""
    if len(pieces) == 1:
        return pieces[0]
    xp = xp_of(pieces[0].arrays[0])
    if isinstance(pieces[0], Ggml) and pieces[0].planes:   # the scale plane (nb, out) joins by its columns
        return with_arrays(pieces[0], [xp.concatenate(a, axis=min(k, 1)) for k, a in enumerate(zip(*(p.planes for p in pieces)))])
    return with_arrays(pieces[0], [xp.concatenate(a) for a in zip(*(p.arrays for p in pieces))])


def with_arrays(w, arrays: list):
    """A compact matrix of w's format and columns holding `arrays` (other rows, or on another device)."""
    if isinstance(w, Ggml):
        return Ggml(w.format, None, w.shape[1], tuple(arrays)) if w.planes else Ggml(w.format, arrays[0], w.shape[1])
    return type(w)(*arrays)


def matrix_bytes(fmt: str, shape) -> int:
    """The bytes an (out, in) matrix asked for in `fmt` takes in memory, in the format it is kept in (kept_format),
    its side arrays included: the `nbytes` it will have, for sizes before anything is read."""
    n_out, n_in = shape
    fmt = kept_format(fmt, n_in)
    if fmt in GGML:   # the planes (Ggml) per block: integers, float32 scales (Q4_K: d, dmin; a byte per 6-bit scale, min)
        block, _ = quants.BLOCKS[GGML[fmt]]
        return n_out * n_in // block * {"Q8_0": 32 + 4, "Q4_0": 16 + 4, "Q4_K": 128 + 8 + 16}[GGML[fmt]]
    if fmt == "int8":   # and a float32 scale per row
        return n_out * n_in + 4 * n_out
    return n_out * n_in * {"float32": 4, "bfloat16": 2, "float16": 2}[fmt]


def fits_format(fmt: str, n_in: int) -> bool:
    """Whether a matrix of n_in columns can be stored in `fmt` (ggml formats need whole blocks per row)."""
    if fmt not in GGML:
        return True
    return n_in % quants.BLOCKS[GGML[fmt]][0] == 0


def kept_format(fmt: str, n_in: int) -> str:
    """The format a matrix of n_in columns is kept in when `fmt` is asked for (npqwen.load, npqwen inspect's sizes,
    the memory check before loading): `fmt`, or where its rows are not whole blocks of that ggml format, the nearest
    that fits: Q8_0 (blocks of 32), else bfloat16."""
    if fits_format(fmt, n_in):
        return fmt
    return "q8_0" if fits_format("q8_0", n_in) else "bfloat16"


def total_bytes(weights: dict) -> int:
    """Bytes the weights hold in memory, each array once (tied lm_head, the views of a stacked matrix)."""
    seen, total = set(), 0
    for w in weights.values():
        for a in (w.parts if isinstance(w, Rows) else [w]):
            if id(a) not in seen:
                seen.add(id(a))
                total += a.nbytes
    return total

