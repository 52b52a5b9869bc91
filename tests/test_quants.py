"""npqwen/quants.py against the references: gguf-py's (de)quantizers bit for bit, and llama.cpp's own
quantize_row_q4_K_ref (node-llama-cpp's prebuilt libggml-base) where gguf has no Q4_K quantizer."""
import ctypes

import numpy as np
import pytest

from npqwen import quants

gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package (pip install gguf) is the reference")
from gguf import GGMLQuantizationType
from gguf_helpers import llama_cpp_lib

ROWS, COLS = 24, 512


def weights(seed=0, rows=ROWS, cols=COLS):
    """Random float32 rows with the awkward blocks a real matrix has: all zero, all equal, one outlier."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.001, 1.0, (rows, 1))).astype(np.float32)
    w[0, :256] = 0.0
    w[1, :256] = 0.25
    w[2, 7] = 40.0
    w[3] = np.abs(w[3]) + 0.5  # all positive: a min of 0
    return w


def assert_bytes_equal(ours, ref, qtype):
    block = quants.BLOCKS[qtype][1]
    ours, ref = ours.reshape(-1, block), ref.reshape(-1, block)
    bad = np.nonzero((ours != ref).any(axis=1))[0]
    assert bad.size == 0, (f"{qtype}: {bad.size} of {len(ours)} blocks differ from the reference; first "
                           f"block {bad[0]}:\nours {ours[bad[0]][:24]}\nref  {ref[bad[0]][:24]}")


def random_blocks(qtype, rng, rows=ROWS, cols=COLS):
    """Random bytes for a qtype with finite float16 scales (where a block keeps them)."""
    block_size, type_size = quants.BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    scale_at = {"Q8_0": [0], "Q4_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
    for at in scale_at.get(qtype, []):
        blocks[:, at:at + 2] = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype in ("F16", "BF16"):  # no NaNs or infinities
        raw = quants.quantize_rows(qtype, rng.standard_normal((rows, cols)).astype(np.float32))
    if qtype == "F32":
        raw = rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_equals_gguf(qtype):
    raw = random_blocks(qtype, np.random.default_rng(1))
    out = np.full((ROWS, COLS), np.nan, np.float32)
    assert quants.dequantize_rows(qtype, raw, out) is out
    ref = gguf_quants.dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32).reshape(ROWS, COLS)
    diff = out.view(np.uint32) != ref.view(np.uint32)
    assert not diff.any(), (f"{qtype}: {diff.sum()} values differ from gguf.quants.dequantize, first at "
                            f"{np.argwhere(diff)[0]}: {out[diff][0]} != {ref[diff][0]}")


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_quantize_equals_gguf(qtype):
    w = weights()
    ours = quants.quantize_rows(qtype, w)
    assert ours.dtype == np.uint8 and ours.shape == (ROWS, quants.row_bytes(qtype, COLS))
    ref = np.ascontiguousarray(gguf_quants.quantize(w, GGMLQuantizationType[qtype])).view(np.uint8)
    assert_bytes_equal(ours, ref, qtype)


def test_q4_k_quantize_equals_llama_cpp():
    """gguf has no Q4_K quantizer: llama.cpp's quantize_row_q4_K_ref is the reference, bit for bit."""
    lib = llama_cpp_lib("libggml-base.so")
    for seed in range(3):
        w = weights(seed, rows=64, cols=1024)
        ref = np.zeros(w.size // 256 * 144, np.uint8)
        lib.quantize_row_q4_K_ref(w.ctypes.data_as(ctypes.c_void_p), ref.ctypes.data_as(ctypes.c_void_p),
                                  ctypes.c_int64(w.size))
        assert_bytes_equal(quants.quantize_rows("Q4_K", w), ref, "Q4_K")


@pytest.mark.parametrize("qtype, rms_limit", [("Q8_0", 0.008), ("Q4_0", 0.15), ("Q4_K", 0.1)])
def test_quantize_then_dequantize_is_close(qtype, rms_limit):
    """A round trip keeps each plain row within the format's error (relative rms); zeros stay zero."""
    w = weights(3)
    back = quants.dequantize_rows(qtype, quants.quantize_rows(qtype, w), np.empty_like(w))
    assert np.all(back[0, :256] == 0)
    rel = np.sqrt(np.mean((back - w) ** 2, axis=1) / np.mean(w ** 2, axis=1))[4:]  # the plain random rows
    assert rel.max() < rms_limit, f"{qtype}: relative rms error {rel.max():.4f} (row {rel.argmax()})"


def test_q8_0_rounds_halves_away_from_zero_as_gguf():
    """quantize_row_q8_0_ref's roundf: with d = 1 (the block's largest |x| is 127) a half rounds away from zero,
    and 0.49999997, the float32 below 0.5, to 0 (adding 0.5 would make it 1)."""
    halves = [127, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 0.49999997, -0.49999997, 1.4999999, 2.5000002, 0]
    w = np.resize(np.array(halves, np.float32), (2, 32))
    ref = np.ascontiguousarray(gguf_quants.quantize(w, GGMLQuantizationType.Q8_0)).view(np.uint8)
    assert_bytes_equal(quants.quantize_rows("Q8_0", w), ref, "Q8_0")


def test_csum_adds_in_the_c_loop_s_order():
    """csum's one np.add.reduce over axis 0 equals adding the rows one by one (NumPy's pairwise sum would not)."""
    rng = np.random.default_rng(4)
    for shape in [(32, 5), (32, 3, 7), (32, 1), (3, 2)]:
        a = (rng.standard_normal(shape) * rng.uniform(0, 1e4, shape)).astype(np.float32)
        by_hand = a[0].copy()
        for row in a[1:]:
            by_hand += row
        ours = quants.csum(a)
        assert (ours.view(np.uint32) == by_hand.view(np.uint32)).all(), (shape, ours, by_hand)


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "q4_0"])
def test_quantizing_in_threads_writes_the_bytes_of_one_thread(fmt):
    """The whole-checkpoint paths quantize parts of a matrix's rows in threads: the blocks are the same bytes."""
    from npqwen.weights import GGML, quantize
    w = weights(5, rows=13, cols=512)
    one = quants.quantize_rows(GGML[fmt], w)
    for threads in (1, 3):
        ours = quantize(w, fmt, threads).storage
        assert_bytes_equal(ours, one, GGML[fmt])
