"""Gated DeltaNet's two forms agree: the chunked delta rule (prefill) and the recurrent one (decode) give the
same outputs and final state, and both equal HF's torch_chunk_gated_delta_rule; so do the convolution and
the gated norm."""
import math

import numpy as np
import pytest

from npqwen import linear_attention as la

from tolerance import CHUNK, EPS32, EPS64, relative_diff, rounding_tolerance

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def inputs(T, Hk, Hv, dk, dv, seed=0, dtype=np.float64):
    """q, k (T, Hv, dk) normalised and scaled, v (T, Hv, dv), g, beta (T, Hv) as a layer computes them,
    a random starting state, and the raw q, k, v, g, beta for HF."""
    rng = np.random.default_rng(seed)
    mixed = rng.standard_normal((T, 2 * Hk * dk + Hv * dv)).astype(dtype)
    a, b = rng.standard_normal((2, T, Hv)).astype(dtype)
    g, beta = la.decay_and_beta(a, b, np.log(rng.uniform(0.01, 16, Hv)), np.ones(Hv))
    q, k, v = la.queries_keys_values(mixed, Hk, dk, Hv, dv)
    state = (0.1 * rng.standard_normal((Hv, dk, dv))).astype(q.dtype)
    raw = (mixed[:, :Hk * dk].reshape(T, Hk, dk), mixed[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk),
           mixed[:, 2 * Hk * dk:].reshape(T, Hv, dv), g, beta)
    return q, k, v, g, beta, state, raw


# (T, Hk, Hv, dk, dv): shorter than a chunk, exactly two chunks, a ragged tail, grouped value heads
SHAPES = [(1, 2, 2, 8, 8), (37, 2, 4, 16, 8), (128, 1, 3, 8, 16), (200, 2, 4, 16, 8), (130, 4, 4, 32, 32)]


def chain_tolerance(shape, eps=EPS32) -> float:
    """The delta rule over T tokens, relative to its largest output: sums of dk, dv or T terms, chained through
    the rows of a chunk's triangular solve (or, token by token, the recurrence) and the chunks' state."""
    T, _, _, dk, dv = shape
    return rounding_tolerance(max(T, dk, dv), min(T, CHUNK) + math.ceil(T / CHUNK), eps)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-Hk{}-Hv{}-dk{}-dv{}".format(*s))
def test_chunked_equals_recurrent(shape):
    q, k, v, g, beta, state, _ = inputs(*shape)
    out_c, state_c = la.chunked_gated_delta_rule(q, k, v, g, beta, state)
    out_r, state_r = la.recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state[None])
    d_out, d_state = relative_diff(out_c, out_r[0]), relative_diff(state_c, state_r[0])
    print(f"T={shape[0]} Hk={shape[1]} Hv={shape[2]}: chunked vs recurrent relative max |diff| outputs {d_out:.2e}, "
          f"final state {d_state:.2e} (float64; max |output| {np.abs(out_r).max():.2f})")
    assert d_out <= chain_tolerance(shape, EPS64) and d_state <= chain_tolerance(shape, EPS64)


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=lambda s: "T{}-Hk{}-Hv{}".format(*s[:3]))
def test_both_forms_equal_hf_in_float32(shape):
    q, k, v, g, beta, state, raw = inputs(*shape, dtype=np.float32)
    t = [torch.from_numpy(np.ascontiguousarray(a))[None] for a in (*raw, state)]
    want_out, want_state = hf.torch_chunk_gated_delta_rule(*t[:5], initial_state=t[5], output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
    want_out, want_state = want_out[0].numpy(), want_state[0].numpy()
    out_c, state_c = la.chunked_gated_delta_rule(q, k, v, g, beta, state)
    out_r, state_r = la.recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state[None])
    for name, out, st in (("chunked", out_c, state_c), ("recurrent", out_r[0], state_r[0])):
        d_out, d_state = relative_diff(out, want_out), relative_diff(st, want_state)
        print(f"T={shape[0]}: {name} vs HF float32 relative max |diff| outputs {d_out:.2e}, final state {d_state:.2e} "
              f"(tolerance {chain_tolerance(shape):.1e})")
        assert d_out <= chain_tolerance(shape) and d_state <= chain_tolerance(shape)


def test_chunks_carry_the_state():
    """A prompt read in two pieces (chunked prefill across engine steps) ends where one read ends."""
    q, k, v, g, beta, state, _ = inputs(150, 2, 4, 16, 8, seed=3)
    whole, s_whole = la.chunked_gated_delta_rule(q, k, v, g, beta, state)
    first, s1 = la.chunked_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], state)
    second, s2 = la.chunked_gated_delta_rule(q[70:], k[70:], v[70:], g[70:], beta[70:], s1)
    bound = chain_tolerance((150, 2, 4, 16, 8), EPS64)   # float64; the split at 70 moves the chunks' edges
    assert relative_diff(np.concatenate([first, second]), whole) <= bound and relative_diff(s2, s_whole) <= bound


def test_convolution_with_state_equals_hf():
    rng = np.random.default_rng(1)
    x, weight = rng.standard_normal((1, 20, 12)).astype(np.float32), rng.standard_normal((12, 4)).astype(np.float32)
    want = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(weight), activation="silu")
    out, state = la.causal_conv1d(x, weight, np.zeros((1, 3, 12), np.float32))
    assert relative_diff(out, want.transpose(1, 2).numpy()) <= rounding_tolerance(4)   # float32 sums of the 4 taps
    head, s = la.causal_conv1d(x[:, :13], weight, np.zeros((1, 3, 12), np.float32))   # then one token at a time
    steps = [head]
    for t in range(13, 20):
        o, s = la.causal_conv1d(x[:, t:t + 1], weight, s)
        steps.append(o)
    assert relative_diff(np.concatenate(steps, axis=1), out) <= rounding_tolerance(4) and np.array_equal(s, state)


def test_gated_norm_equals_hf():
    rng = np.random.default_rng(2)
    x, z = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    weight = (1 + 0.2 * rng.standard_normal(8)).astype(np.float32)
    norm = hf.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(weight))
        want = norm(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    # float32: a mean of 8 squares, its rsqrt, then the weight and silu(z)
    assert relative_diff(la.gated_rms_norm(x, z, weight, 1e-6), want) <= rounding_tolerance(8, 2)
