"""The ggml block formats of GGUF files, in NumPy: each one a short function over its blocks.

Written as llama.cpp's reference C (`ggml-quants.c`: `dequantize_row_q8_0`, `quantize_row_q4_K_ref`...)
and gguf-py's `quants.py` describe them, and tested bit for bit against `gguf.quants` and against
llama.cpp's own quantizer (tests/test_quants.py). A row of a GGUF matrix is a run of blocks; a block
holds `block_size` weights in `type_size` bytes. `dequantize_rows` widens a few rows into a float32
buffer the caller reuses (a weight object widens a block of rows at a time, never a whole model);
`quantize_rows` writes the bytes a GGUF file stores.
"""

import numpy as np

from .errors import NpqwenError

QK_K = 256  # weights in a k-quant super-block

# qtype -> (weights per block, bytes per block); the names and sizes of gguf's GGML_QUANT_SIZES
BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes one row of `cols` weights takes in `qtype`."""
    block_size, type_size = BLOCKS[qtype]
    assert cols % block_size == 0, f"{qtype} rows hold a multiple of {block_size} weights, not {cols}"
    return cols // block_size * type_size


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (..., 1) float32: a float16 stored little-endian, widened."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


# ---------------------------------------------------------------- dequantize, one function per format
# Each takes `b` (N, type_size) uint8 blocks and fills `out` (N, block_size) float32 with their weights.


def dequantize_q8_0(b, out):
    # block_q8_0: f16 d | int8 qs[32];  w = d * q
    d = _f16(b[:, :2])  # (N, 1)
    q = b[:, 2:].view(np.int8)  # (N, 32)
    np.multiply(q, d, out=out)


def dequantize_q4_0(b, out):
    # block_q4_0: f16 d | uint8 qs[16];  w[j] = d * ((qs[j] & 0xF) - 8), w[j+16] = d * ((qs[j] >> 4) - 8)
    d = _f16(b[:, :2])  # (N, 1)
    qs = b[:, 2:]  # (N, 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - 8  # (N, 32)
    np.multiply(q, d, out=out)


def k_scale_min(s):
    """(N, 12) packed 6-bit scales and mins of a Q4_K/Q5_K block -> (N, 8) scales, (N, 8) mins.

    ggml's get_scale_min_k4: sub-blocks 0-3 keep their 6 bits in the low bits of bytes 0-3 (scale)
    and 4-7 (min); sub-blocks 4-7 keep their low 4 bits in bytes 8-11 (scale low nibble, min high
    nibble) and their top 2 bits in the top 2 bits of bytes 0-3 (scale) and 4-7 (min).
    """
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, m  # (N, 8) each, 0..63


def nibbles(qs):
    """(N, k, 32) bytes -> (N, k, 2, 32) 4-bit values: the low nibbles, then the high ones."""
    q = np.empty((*qs.shape[:-1], 2, 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[..., 0, :])
    np.right_shift(qs, 4, out=q[..., 1, :])
    return q


def dequantize_q4_k(b, out):
    # block_q4_K: f16 d | f16 dmin | uint8 scales[12] | uint8 qs[128]
    # 8 sub-blocks of 32 weights: w = d * sc[j] * q - dmin * m[j], q a 4-bit value; each 32 bytes of
    # qs hold two sub-blocks: the low nibbles sub-block 2i, the high nibbles sub-block 2i+1.
    N = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (N, 1)
    sc, m = k_scale_min(b[:, 4:16])  # (N, 8)
    q = nibbles(b[:, 16:].reshape(N, 4, 32)).reshape(N, 8, 32)  # (N, 8, 32)
    w = out.reshape(N, 8, 32)
    np.multiply((d * sc)[..., None], q, out=w)
    w -= (dmin * m)[..., None]


def dequantize_q5_k(b, out):
    # block_q5_K: f16 d | f16 dmin | uint8 scales[12] | uint8 qh[32] | uint8 qs[128]
    # as Q4_K, with a 5th bit per weight: bit j of qh[l] is the high bit of weight l of sub-block j.
    N = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (N, 1)
    sc, m = k_scale_min(b[:, 4:16])  # (N, 8)
    qh = b[:, 16:48]  # (N, 32)
    q = nibbles(b[:, 48:].reshape(N, 4, 32)).reshape(N, 8, 32)  # (N, 8, 32)
    q |= ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4  # 0..31
    w = out.reshape(N, 8, 32)
    np.multiply((d * sc)[..., None], q, out=w)
    w -= (dmin * m)[..., None]


def dequantize_q6_k(b, out):
    # block_q6_K: uint8 ql[128] | uint8 qh[64] | int8 scales[16] | f16 d
    # 16 sub-blocks of 16 weights: w = d * scales[j] * (q - 32), q a 6-bit value. Each half of 128
    # weights takes 64 bytes of ql and 32 of qh: weights l, l+32, l+64, l+96 (l < 32) take the low
    # nibble of ql[l], of ql[l+32], the high nibble of ql[l], of ql[l+32], and bits 0-1, 2-3, 4-5,
    # 6-7 of qh[l] as their top two bits.
    N = b.shape[0]
    q = nibbles(b[:, :128].reshape(N, 2, 2, 32)).transpose(0, 1, 3, 2, 4).reshape(N, 2, 4, 32)  # low 4 bits
    qh = b[:, 128:192].reshape(N, 2, 1, 32)  # (N, 2, 1, 32)
    q |= ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3) << 4  # 0..63
    scales = b[:, 192:208].view(np.int8)  # (N, 16)
    d = _f16(b[:, 208:210])  # (N, 1)
    np.multiply((d * scales).reshape(N, 16, 1), q.view(np.int8).reshape(N, 16, 16) - np.int8(32),
                out=out.reshape(N, 16, 16))


DEQUANTIZE_BLOCKS = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_K": dequantize_q4_k,
                     "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}


def dequantize_rows(qtype: str, raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """(rows, row_bytes) uint8 rows of a `qtype` matrix -> `out` (rows, cols) float32, filled and returned."""
    rows, cols = out.shape
    assert raw.shape == (rows, row_bytes(qtype, cols)), (raw.shape, qtype, out.shape)
    if qtype == "F32":
        out[...] = raw.view(np.float32)
    elif qtype == "F16":
        out[...] = raw.view(np.float16)
    elif qtype == "BF16":
        # a bfloat16 is the top half of a float32: shift its 16 bits up
        out.view(np.uint32)[...] = raw.view(np.uint16).astype(np.uint32) << 16
    else:
        block_size, type_size = BLOCKS[qtype]
        blocks = np.ascontiguousarray(raw).reshape(-1, type_size)  # (rows * cols / block_size, type_size)
        target = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
        DEQUANTIZE_BLOCKS[qtype](blocks, target.reshape(-1, block_size))
        if target is not out:
            out[...] = target
    return out


# ---------------------------------------------------------------- quantize (llama.cpp's *_ref functions)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """(N, 1) float32 -> (N, 2) uint8: rounded to float16 (nearest even, as GGML_FP32_TO_FP16)."""
    return x.astype(np.float16).view(np.uint8)


def roundf(v):
    """C's roundf: to nearest, ties away from zero, as trunc(v + copysign(0.5 - 2**-25, v)): equal for every
    float32 of |v| < 2**23 (checked one by one); with 0.5 itself 0.49999997 would round up to 1."""
    r = np.copysign(np.float32(0.5 - 2**-25), v)
    np.add(r, v, out=r)
    return np.trunc(r, out=r)


def quantize_q8_0(x):
    # quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) (half away from zero)
    # max |x| as max(max x, -min x), two reductions rather than a pass for |x|; abs makes an all-zero block's
    # -0.0 the C's +0
    amax = np.abs(np.maximum(x.max(axis=1, keepdims=True), -x.min(axis=1, keepdims=True)))  # (N, 1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    out = np.empty((len(x), 34), np.uint8)
    out[:, :2] = _f16_bytes(d)
    out[:, 2:] = roundf(x * inv_d).astype(np.int8).view(np.uint8)  # (N, 32)
    return out


def quantize_q4_0(x):
    # quantize_row_q4_0_ref: d = max / -8 where max is the value of largest |x| (first if tied),
    # q = min(15, (int8)(x / d + 8.5)); byte j holds q[j] (low nibble) and q[j+16] (high nibble)
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)  # (N, 1)
    d = big / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.minimum(15, np.trunc(x * inv_d + np.float32(8.5))).astype(np.uint8)  # (N, 32)
    return np.concatenate([_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], axis=1)  # (N, 18)


def nearest_int(x):
    """ggml's nearest_int: round to nearest, ties to even (its 1.5 * 2**23 trick), as int32."""
    return np.rint(x).astype(np.int32)


def csum(a):
    """Sum over axis 0 in order, a[0] + a[1] + ..., as a C loop adds. NumPy adds along an axis that is not the
    contiguous one a term at a time (its pairwise sum is for the contiguous axis: numpy.sum's notes), as it does
    along axis 0 of a C-contiguous array whose a[0] holds more than one value; else the loop by hand."""
    if a.flags.c_contiguous and a[0].size > 1:
        return np.add.reduce(a, axis=0)
    total = a[0].copy()
    for row in a[1:]:
        total += row
    return total


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep):
    """ggml's make_qkx2_quants (least squares, use_mad false), for many 32-weight sub-blocks at once.

    x, weights: (n, N) -- one column per sub-block; every sum adds its n terms in the C loop's
    order (csum), so that the float32 results are llama.cpp's bit for bit. Returns (scale (N,),
    -min (N,), L (n, N) uint8): x ~= scale * L + min, min <= 0, L in 0..nmax; tries nstep+1 scales
    around nmax / (max - min) and keeps the one with the least weighted squared error.
    A step is a dozen whole-array passes into buffers made once. The levels of the best step are not
    copied at each step (np.where on an (n, N) array takes 15x a product's time): its iscale and min
    are, and levels() makes the same levels from them at the end.
    """
    f32 = np.float32
    n, N = x.shape
    xmin = np.minimum(x.min(axis=0), f32(0))  # (N,)
    xmax = x.max(axis=0)
    sum_w = csum(weights)
    sum_x = csum(weights * x)
    flat = xmax == xmin  # all weights equal (or all >= 0 and max 0): level 0, min the value (the C returns early)
    xmax[flat] += f32(1)
    Laux, wl, wl2, wlx, diff = np.empty((5, n, N), f32)  # the levels a step tries; w*l, w*l*l, w*l*x; its error terms

    def levels(iscale, xmin):  # (N,), (N,) -> Laux (n, N): nearest_int(iscale * (x - min)) in 0..nmax, as float32
        np.subtract(x, xmin, out=Laux)
        np.multiply(Laux, iscale, out=Laux)
        np.rint(Laux, out=Laux)
        return np.clip(Laux, f32(0), f32(nmax), out=Laux)

    def weighted_error(scale, xmin):  # (N,), (N,) -> (N,): the sum of w * (scale * l + min - x)^2 over Laux
        np.multiply(Laux, scale, out=diff)
        np.add(diff, xmin, out=diff)
        np.subtract(diff, x, out=diff)
        np.square(diff, out=diff)
        np.multiply(diff, weights, out=diff)
        return csum(diff)

    iscale = f32(nmax) / (xmax - xmin)
    scale = f32(1) / iscale
    levels(iscale, xmin)
    best_error = weighted_error(scale, xmin)
    best_error[flat] = -np.inf  # never beaten
    best_iscale, best_min = iscale, xmin.copy()  # what levels() makes the best levels from
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            # as in the C, a better min found on the way moves the range the next steps try
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (xmax - xmin)  # (N,)
            levels(iscale, xmin)
            np.multiply(weights, Laux, out=wl)
            np.multiply(wl, Laux, out=wl2)
            np.multiply(wl, x, out=wlx)
            sum_l, sum_l2, sum_xl = csum(wl), csum(wl2), csum(wlx)  # (N,) each
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0  # a positive min is not allowed: fit the scale alone
            np.divide(sum_xl, sum_l2, out=this_scale, where=pos)
            this_min[pos] = 0
            cur_error = weighted_error(this_scale, this_min)
            better = (D > 0) & (cur_error < best_error)  # (the C skips a step whose D is not > 0)
            np.copyto(best_error, cur_error, where=better)
            np.copyto(scale, this_scale, where=better)
            np.copyto(best_iscale, iscale, where=better)
            np.copyto(best_min, xmin, where=better)
            np.copyto(xmin, this_min, where=better)
    L = levels(best_iscale, best_min)
    L[:, flat] = 0
    scale[flat] = 0
    return scale, -xmin, L.astype(np.uint8)


def quantize_q4_k(x):
    """(N, 256) float32 super-blocks -> (N, 144) bytes, CHUNK super-blocks at a time: the twenty-odd
    (32, 8 * CHUNK) float32 arrays of one chunk's search stay in the core's cache (2x faster than all at once)."""
    return np.concatenate([quantize_q4_k_blocks(x[a:a + CHUNK]) for a in range(0, len(x), CHUNK)]) \
        if len(x) else np.empty((0, 144), np.uint8)


CHUNK = 128   # super-blocks quantized at a time (32K values)


def quantize_q4_k_blocks(x):
    # quantize_row_q4_K_ref: each 32-weight sub-block gets a scale and a min by make_qkx2_quants
    # (weights av_x + |x|, av_x the sub-block's rms); the 8 scales and 8 mins are then quantized to
    # 6 bits against the block's largest (d = max_scale / 63, dmin = max_min / 63), and the weights
    # quantized again to 4 bits with those rounded scales.
    f32 = np.float32
    N = x.shape[0]
    # (32, N*8): one column per sub-block, copied so that each row is contiguous: every step below adds or
    # multiplies whole rows (a strided view made this 10x slower)
    xs = np.ascontiguousarray(x.reshape(N * 8, 32).T)
    av_x = np.sqrt(csum(xs * xs) / f32(32))  # (N*8,)
    scales, mins, L0 = make_qkx2_quants(xs, av_x + np.abs(xs), 15, -1.0, 0.1, 20)
    scales, mins = scales.reshape(N, 8), mins.reshape(N, 8)
    max_scale = np.maximum(scales.max(axis=1, keepdims=True), f32(0))  # (N, 1)
    max_min = np.maximum(mins.max(axis=1, keepdims=True), f32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    ls = np.minimum(63, nearest_int(inv_scale * scales)).astype(np.uint8)  # (N, 8)
    lm = np.minimum(63, nearest_int(inv_min * mins)).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6),  # bytes 0-3: scale 0-3, top bits of scale 4-7
                             lm[:, :4] | ((lm[:, 4:] >> 4) << 6),  # bytes 4-7: min 0-3, top bits of min 4-7
                             (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)], axis=1)  # (N, 12)
    d, dmin = _f16_bytes(max_scale / f32(63)), _f16_bytes(max_min / f32(63))  # (N, 2) each
    # the 4-bit levels again, with the scales as a reader will see them, in the search's (32, N*8) layout
    sc, m = k_scale_min(packed)
    dd = (_f16(d) * sc).reshape(N * 8)  # (N*8,)
    dm = (_f16(dmin) * m).reshape(N * 8)
    L = np.add(xs, dm, out=xs)  # (32, N*8): nearest_int((x + dm) / dd) in 0..15, as float32
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(L, dd, out=L)
    np.clip(np.rint(L, out=L), f32(0), f32(15), out=L)
    zero = dd == 0
    L[:, zero] = 0
    L = L.astype(np.uint8)
    L[:, zero] = L0[:, zero]  # a zero scale keeps the first levels (the C `continue`)
    L = L.T.reshape(N, 4, 2, 32)
    qs = L[:, :, 0] | (L[:, :, 1] << 4)  # (N, 4, 32): byte l of chunk i is sub-block 2i | 2i+1 << 4
    return np.concatenate([d, dmin, packed, qs.reshape(N, 128)], axis=1)  # (N, 144)


QUANTIZE_BLOCKS = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_K": quantize_q4_k}


def quantize_rows(qtype: str, w: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> (rows, row_bytes) uint8, the bytes llama.cpp's quantizer writes."""
    if qtype not in ("F32", "F16", "BF16", *QUANTIZE_BLOCKS):
        raise NpqwenError(f"npqwen cannot quantize to {qtype}: it writes F32, F16, BF16, "
                          f"{', '.join(QUANTIZE_BLOCKS)}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, cols = w.shape
    if qtype == "F32":
        return w.view(np.uint8).copy()
    if qtype == "F16":
        return w.astype(np.float16).view(np.uint8)
    if qtype == "BF16":
        # ggml_compute_fp32_to_bf16: round to nearest even (NaN kept quiet)
        n = w.view(np.uint32).astype(np.uint64)
        nan = (n & 0x7FFFFFFF) > 0x7F800000
        rounded = (n + 0x7FFF + ((n >> 16) & 1)) >> 16
        bits = np.where(nan, (n >> 16) | 64, rounded).astype(np.uint16)
        return bits.view(np.uint8).reshape(rows, -1)
    block_size, _ = BLOCKS[qtype]
    blocks = w.reshape(-1, block_size)  # (rows * cols / block_size, block_size)
    return QUANTIZE_BLOCKS[qtype](blocks).reshape(rows, row_bytes(qtype, cols))
