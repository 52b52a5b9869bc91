"""Backward passes (npqwen/grad.py and each operator's `_backward`): every operator against central finite
differences in float64 and against torch autograd; the whole model's gradients, of every weight and of every
activation HF has a module (or a module's input) for, against HF transformers' `.backward()` (Qwen3 and
Qwen3-MoE, Qwen3.5): float64 within 1e-10 and float32 within 1e-5 (Qwen3.5: nearer float64's than HF's
float32 is), relative to the largest value of each tensor."""
import re

import numpy as np
import pytest

import npqwen
from npqwen import grad, moe, ops, ple, qsa
from npqwen import hyper_connections as hc
from npqwen import linear_attention as la
from npqwen.config import Qwen3Config
from npqwen.hooks import step_names

from conftest import build_hf_checkpoint, hf_model, tiny_config, tiny_moe_config
from hybrid_checkpoints import (build_hybrid_checkpoint, hf_hybrid_model, hybrid_config, hybrid_moe_config,
                                qwen3_next_config)

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(0)


def rel(a, b) -> float:
    """max |a - b| / max |b|: the difference relative to the reference tensor's scale."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# -- each operator: finite differences in float64, torch autograd --

def finite_differences(f, inputs, d_out, eps=1e-6):
    """d sum(f(*inputs) * d_out) / d each input, every element by central differences."""
    grads = []
    for x in inputs:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = float((f(*inputs) * d_out).sum())
            x[idx] = old - eps
            down = float((f(*inputs) * d_out).sum())
            x[idx] = old
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def rope_tables(T, Dh, rotary=None):
    cfg = Qwen3Config.from_dict(tiny_config(head_dim=Dh))
    inv = ops.rope_frequencies(cfg)[0][: (rotary or Dh) // 2]
    return ops.rope_cos_sin(inv, np.arange(T), 1.0, np.float64)


def torch_rope(x, cos, sin):
    """HF's apply_rotary_pos_emb on (T, n, Dh), partial rotary as Qwen3.5's."""
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    x1, x2 = xr[..., :r // 2], xr[..., r // 2:]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([xr * c + torch.cat([-x2, x1], -1) * s, rest], -1)


def torch_attention(q, k, v):
    """HF's eager attention for one sequence: repeat_kv, scaled scores, causal mask, softmax, @ v."""
    T, H, Dh = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)        # (T, H, Dh) heads 0,0,1,1
    s = torch.einsum("thd,shd->hts", q, k) / Dh ** 0.5
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, H * Dh)


def moe_case():
    T, D, E, k, I = 5, 6, 4, 2, 3
    x, gate = RNG.standard_normal((T, D)), RNG.standard_normal((E, D))
    chosen = moe.route(x, gate, k, True)[1]
    return T, D, E, k, I, x, gate, chosen


def renormalise(p):
    return p / p.sum(-1, keepdim=True)


def torch_experts(x, chosen, w, gate_up, down):
    I = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(chosen[t]):
            h = gate_up[e] @ x[t]
            out[t] = out[t] + w[t, j] * (down[e] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    return out


def operator_cases():
    """(name, forward over the differentiable inputs, backward(d_out, *inputs), inputs, torch forward)."""
    T, D, H, K, Dh, V = 4, 6, 4, 2, 4, 9
    ids = np.array([3, 1, 3, 7])   # token 3 twice: its row sums both
    cos, sin = rope_tables(T, Dh)
    pcos, psin = rope_tables(T, 8, rotary=4)
    targets = np.array([2, -100, 5, 0])
    _, mD, mE, mk, mI, mx, mgate, chosen = moe_case()
    tc = torch.from_numpy
    yield ("embed", lambda w: ops.embed(w, ids), lambda d, w: [ops.embed_backward(d, ids, V)],
           [RNG.standard_normal((V, D))], lambda w: w[tc(ids)])
    yield ("linear", ops.linear, lambda d, x, w: ops.linear_backward(d, x, w),
           [RNG.standard_normal((T, D)), RNG.standard_normal((5, D))], lambda x, w: x @ w.T)
    for offset in (0.0, 1.0):   # Qwen3's norm and Qwen3.5's (1 + weight)
        yield (f"rms_norm offset {offset}", lambda x, w, o=offset: ops.rms_norm(x, w, 1e-6, o),
               lambda d, x, w, o=offset: ops.rms_norm_backward(d, x, w, 1e-6, o),
               [RNG.standard_normal((T, H, Dh)), RNG.standard_normal(Dh)],
               lambda x, w, o=offset: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (o + w))
    yield ("sigmoid", ops.sigmoid, lambda d, x: [ops.sigmoid_backward(d, x)], [RNG.standard_normal((T, D))],
           torch.sigmoid)
    yield ("silu", lambda x: ops.silu(x.copy()), lambda d, x: [ops.silu_backward(d, x)],
           [3 * RNG.standard_normal((T, D))], torch.nn.functional.silu)
    yield ("swiglu", ops.swiglu, lambda d, g, u: ops.swiglu_backward(d, g, u),
           [RNG.standard_normal((T, D)), RNG.standard_normal((T, D))],
           lambda g, u: torch.nn.functional.silu(g) * u)
    yield ("apply_rope", lambda x: ops.apply_rope(x, cos, sin), lambda d, x: [ops.apply_rope_backward(d, cos, sin)],
           [RNG.standard_normal((T, H, Dh))], lambda x: torch_rope(x, tc(cos), tc(sin)))
    yield ("apply_rope partial", lambda x: ops.apply_rope(x, pcos, psin),
           lambda d, x: [ops.apply_rope_backward(d, pcos, psin)],
           [RNG.standard_normal((T, H, 8))], lambda x: torch_rope(x, tc(pcos), tc(psin)))
    yield ("causal_attention (GQA)", lambda q, k, v: ops.causal_attention(q, k, v)[0],
           lambda d, q, k, v: ops.causal_attention_backward(d, q, k, v, ops.causal_attention(q, k, v)[1]),
           [RNG.standard_normal((T, H, Dh)), RNG.standard_normal((T, K, Dh)), RNG.standard_normal((T, K, Dh))],
           torch_attention)
    yield ("cross_entropy", lambda z: np.array(ops.cross_entropy(z, targets)),
           lambda d, z: [d * ops.cross_entropy_backward(z, targets)], [RNG.standard_normal((T, V))],
           lambda z: torch.nn.functional.cross_entropy(z, tc(targets)))
    yield ("route (renormalised top-k)", lambda x, g: moe.route(x, g, mk, True)[2],
           lambda d, x, g: moe.route_backward(d, x, g, ops.linear(x, g), chosen, True)[:2], [mx, mgate],
           lambda x, g: renormalise(torch.gather((x @ g.T).softmax(-1), 1, tc(chosen))))
    weights = moe.route(mx, mgate, mk, True)[2]
    yield ("experts", lambda x, w, gu, dn: moe.experts(x, chosen, w, gu, dn),
           lambda d, x, w, gu, dn: moe.experts_backward(d, x, chosen, w, gu, dn),
           [mx, weights.copy(), RNG.standard_normal((mE, 2 * mI, mD)), RNG.standard_normal((mE, mD, mI))],
           lambda x, w, gu, dn: torch_experts(x, chosen, w, gu, dn))


def torch_delta_rule(q, k, v, g, beta):
    """The gated delta rule token by token from a zero state, (B, T, Hv, d) as linear_attention.py writes it."""
    S = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=q.dtype)
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1)


def torch_conv(x, w, W=4):
    """Depthwise causal convolution of (1, T, C) from zeros, then SiLU."""
    padded = torch.cat([torch.zeros(1, W - 1, x.shape[2], dtype=x.dtype), x], 1)
    return torch.nn.functional.silu(sum(padded[:, j:j + x.shape[1]] * w[:, j] for j in range(W)))


def torch_qkv(mixed, Hk=2, dk=3, Hv=4, dv=2):
    T = mixed.shape[0]
    q, k = mixed[:, :Hk * dk].reshape(T, Hk, dk), mixed[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
    q, k = q.repeat_interleave(Hv // Hk, 1), k.repeat_interleave(Hv // Hk, 1)
    def l2(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    return torch.cat([(l2(q) * dk ** -0.5).reshape(T, -1), l2(k).reshape(T, -1), mixed[:, 2 * Hk * dk:]], 1)


def linear_attention_cases():
    """Gated DeltaNet's functions (Qwen3.5): B=1 sequence, T tokens, Hv=4 value heads reading Hk=2 key heads."""
    T, Hk, Hv, dk, dv, C, W = 5, 2, 4, 3, 2, 2 * 2 * 3 + 4 * 2, 4
    zero_state = np.zeros((1, W - 1, C))
    yield ("causal_conv1d", lambda x, w: la.causal_conv1d(x, w, zero_state)[0],
           lambda d, x, w: la.causal_conv1d_backward(d, x, w, zero_state)[:2],
           [RNG.standard_normal((1, T, C)), RNG.standard_normal((C, W))], torch_conv)
    yield ("l2norm", la.l2norm, lambda d, x: [la.l2norm_backward(d, x)], [RNG.standard_normal((T, Hv, dk))],
           lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    yield ("queries_keys_values", lambda m: np.concatenate([a.reshape(T, -1) for a in
                                                             la.queries_keys_values(m, Hk, dk, Hv, dv)], 1),
           lambda d, m: [la.queries_keys_values_backward(
               d[:, :Hv * dk].reshape(T, Hv, dk), d[:, Hv * dk:2 * Hv * dk].reshape(T, Hv, dk),
               d[:, 2 * Hv * dk:].reshape(T, Hv, dv), m, Hk, dk, Hv, dv)],
           [RNG.standard_normal((T, C))], torch_qkv)
    state = np.zeros((1, Hv, dk, dv))
    yield ("recurrent_gated_delta_rule", lambda q, k, v, g, b: la.recurrent_gated_delta_rule(q, k, v, g, b, state)[0],
           lambda d, q, k, v, g, b: la.recurrent_gated_delta_rule_backward(d, q, k, v, g, b, state)[:5],
           [RNG.standard_normal((1, T, Hv, dk)), RNG.standard_normal((1, T, Hv, dk)), RNG.standard_normal((1, T, Hv, dv)),
            -RNG.random((1, T, Hv)), RNG.random((1, T, Hv))], torch_delta_rule)
    yield ("gated_rms_norm", lambda x, z, w: la.gated_rms_norm(x, z, w, 1e-6),
           lambda d, x, z, w: la.gated_rms_norm_backward(d, x, z, w, 1e-6),
           [RNG.standard_normal((T, Hv, dv)), RNG.standard_normal((T, Hv, dv)), RNG.standard_normal(dv)],
           lambda x, z, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.nn.functional.silu(z))
    yield ("gated_rms_norm, sigmoid gate (Qwen4-Exp's output_gate_type)",
           lambda x, z, w: la.gated_rms_norm(x, z, w, 1e-6, la.sigmoid),
           lambda d, x, z, w: la.gated_rms_norm_backward(d, x, z, w, 1e-6, la.sigmoid),
           [RNG.standard_normal((T, Hv, dv)), RNG.standard_normal((T, Hv, dv)), RNG.standard_normal(dv)],
           lambda x, z, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(z))
    yield ("decay_and_beta", lambda a, b, A, dt: np.stack(la.decay_and_beta(a, b, A, dt)),
           lambda d, a, b, A, dt: la.decay_and_beta_backward(d[0], d[1], a, b, A, dt),
           [3 * RNG.standard_normal((T, Hv)), RNG.standard_normal((T, Hv)), RNG.standard_normal(Hv), RNG.standard_normal(Hv)],
           lambda a, b, A, dt: torch.stack([-A.exp() * torch.nn.functional.softplus(a + dt), torch.sigmoid(b)]))


def torch_grouped_norm(x, w, D, eps=1e-6):
    """HF's Qwen4ExpTextRMSNorm with group_size=D (without its float32 cast): each stream normalised, * (1 + w)."""
    h = x.reshape(x.shape[0], -1, D)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape) * (1 + w)


def torch_gated_residual(x, nw, down, up, inj, C):
    """HF's Qwen4ExpTextGatedResidual.forward: the mixed input and the injection weights, side by side (T, D + C)."""
    T, D = x.shape[0], x.shape[1] // C
    h = torch_grouped_norm(x, nw, D)
    gate = torch.sigmoid(torch.nn.functional.silu(h @ down.T / C) @ up.T).reshape(T, C, D)
    return torch.cat([(gate * h.reshape(T, C, D)).mean(1), 2 * torch.sigmoid(h @ inj.T / C)], 1)


def torch_sparse_attention(q, k, v, allowed):
    n, H, Dh = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)        # (S, H, Dh)
    s = torch.einsum("thd,shd->hts", q, k) / Dh ** 0.5
    s = s.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(n, H * Dh)


def torch_dilated_conv(x, kernel, dilation):
    """HF's PLE convolution: depthwise Conv1d with dilation over (C*D, T), padded on the left with zeros."""
    L = (kernel.shape[1] - 1) * dilation
    xt = torch.nn.functional.pad(x.T[None], (L, 0))
    return torch.nn.functional.conv1d(xt, kernel[:, None], groups=x.shape[1], dilation=dilation)[0].T


def torch_ple(x, emb, wk, wv, nk, nq, nc, conv, C, dilation):
    """HF's Qwen4ExpTextPLELayer.forward from its embeddings (without the norms' float32 casts)."""
    T, D = x.shape[0], x.shape[1] // C
    key = torch_grouped_norm(emb @ wk.T, nk, D).reshape(T, C, D)
    value = emb @ wv.T
    gate = (key * torch_grouped_norm(x, nq, D).reshape(T, C, D)).sum(-1, keepdim=True) / D ** 0.5
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value[:, None]).reshape(T, C * D)
    return gated + torch.nn.functional.silu(torch_dilated_conv(torch_grouped_norm(gated, nc, D), conv[:, 0], dilation))


def qwen4_exp_cases():
    """Qwen4-Exp's functions: hyper-connections (C=3 streams of D=4, rank R=2), QSA's attention over a selection of
    n=3 queries from S=6 positions, PLE's dilated convolution and layer (E=6, kernel 3, dilation 2)."""
    T, C, D, R, E, Kc, dil = 5, 3, 4, 2, 6, 3, 2
    yield ("grouped_rms_norm", lambda x, w: hc.grouped_rms_norm(x, w, D, 1e-6),
           lambda d, x, w: hc.grouped_rms_norm_backward(d, x, w, D, 1e-6),
           [RNG.standard_normal((T, C * D)), RNG.standard_normal(C * D)], lambda x, w: torch_grouped_norm(x, w, D))
    yield ("gated_residual (mixing + injection weights)",
           lambda x, nw, dn, up, inj: np.concatenate([a for a in hc.gated_residual(x, nw, dn, up, inj, C, 1e-6)
                                                       if a is not x], 1),
           lambda d, x, nw, dn, up, inj: hc.gated_residual_backward(d[:, :D], d[:, D:], x, nw, dn, up, inj, C, 1e-6),
           [RNG.standard_normal((T, C * D)), 0.3 * RNG.standard_normal(C * D), RNG.standard_normal((R, C * D)),
            RNG.standard_normal((C * D, R)), RNG.standard_normal((C, C * D))],
           lambda *a: torch_gated_residual(*a, C))
    yield ("inject", hc.inject, lambda d, x, out, w: hc.inject_backward(d, out, w),
           [RNG.standard_normal((T, C * D)), RNG.standard_normal((T, D)), RNG.random((T, C))],
           lambda x, out, w: x + (w[:, :, None] * out[:, None, :]).reshape(x.shape))
    allowed = np.array([[1, 0, 1, 1, 0, 0], [0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1]], dtype=bool)   # (n, S)
    yield ("QSA sparse_attention (GQA, a selection)", lambda q, k, v: qsa.sparse_attention(q, k, v, allowed)[0],
           lambda d, q, k, v: qsa.sparse_attention_backward(d, q, k, v, qsa.sparse_attention(q, k, v, allowed)[1]),
           [RNG.standard_normal((3, 4, D)), RNG.standard_normal((6, 2, D)), RNG.standard_normal((6, 2, D))],
           lambda q, k, v: torch_sparse_attention(q, k, v, allowed))
    zero = np.zeros(((Kc - 1) * dil, C * D))
    yield ("PLE dilated_causal_conv", lambda x, k: ple.dilated_causal_conv(x, k, zero, dil)[0],
           lambda d, x, k: ple.dilated_causal_conv_backward(d, x, k, zero, dil),
           [RNG.standard_normal((T, C * D)), RNG.standard_normal((C * D, Kc))],
           lambda x, k: torch_dilated_conv(x, k, dil))
    names = ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d")

    def ple_weights(wk, wv, nk, nq, nc, conv):
        return {f"p.{n}.weight": w for n, w in zip(names, (wk, wv, nk, nq, nc, conv))}
    yield ("PLE ple_layer", lambda x, emb, *w: ple.ple_layer(x, emb, ple_weights(*w), "p", C, zero, dil, 1e-6)[0],
           lambda d, x, emb, *w: [*ple.ple_layer_backward(d, x, emb, ple_weights(*w), "p", C, dil, 1e-6)[:2],
                                  *ple.ple_layer_backward(d, x, emb, ple_weights(*w), "p", C, dil, 1e-6)[2].values()],
           [RNG.standard_normal((T, C * D)), RNG.standard_normal((T, E)), RNG.standard_normal((C * D, E)),
            RNG.standard_normal((D, E)), 0.3 * RNG.standard_normal(C * D), 0.3 * RNG.standard_normal(C * D),
            0.3 * RNG.standard_normal(C * D), RNG.standard_normal((C * D, 1, Kc))],
           lambda *a: torch_ple(*a, C, dil))


CASES = list(operator_cases()) + list(linear_attention_cases()) + list(qwen4_exp_cases())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_backward_equals_finite_differences_in_float64(case):
    name, forward, backward, inputs, _ = case
    d_out = RNG.standard_normal(np.shape(forward(*inputs)))
    ours = backward(d_out, *inputs)
    numeric = finite_differences(forward, inputs, d_out)
    for i, (a, b) in enumerate(zip(ours, numeric)):
        print(f"{name} input {i}: max |ours - finite differences| / max = {rel(a, b):.2e}")
        assert a.shape == b.shape and rel(a, b) < 1e-7


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_backward_equals_torch_autograd(case):
    name, forward, backward, inputs, torch_forward = case
    d_out = RNG.standard_normal(np.shape(forward(*inputs)))
    ts = [torch.tensor(x, requires_grad=True) for x in inputs]
    out = torch_forward(*ts)
    assert rel(forward(*inputs), out.detach().numpy()) < 1e-12, "the forwards differ"
    (out * torch.from_numpy(d_out)).sum().backward()
    for i, (a, t) in enumerate(zip(backward(d_out, *inputs), ts)):
        print(f"{name} input {i}: max |ours - torch| / max = {rel(a, t.grad.numpy()):.2e}")
        assert rel(a, t.grad.numpy()) < 1e-12


@pytest.mark.parametrize("case", [c for c in qwen4_exp_cases() if "dilated" not in c[0]], ids=lambda c: c[0])
def test_qwen4_exp_backwards_on_the_cupy_stand_in(case, monkeypatch):
    """Each Qwen4-Exp backward on device arrays (tests/strict_cupy.py, which refuses what CuPy refuses) gives the
    NumPy results. (The dilated convolution runs inside ple_layer_backward, which makes its own zero state.)"""
    import strict_cupy
    from npqwen.backend import to_numpy

    cupy = strict_cupy.install(monkeypatch)
    name, forward, backward, inputs, _ = case
    d_out = RNG.standard_normal(np.shape(forward(*inputs)))
    for got, want in zip(backward(cupy.asarray(d_out), *[cupy.asarray(x) for x in inputs]), backward(d_out, *inputs)):
        assert isinstance(got, cupy.ndarray) and np.array_equal(to_numpy(got), want), name


# -- the whole model against HF transformers' backward --

IDS = [5, 17, 33, 2, 101, 7, 64, 250, 3, 99, 17, 400]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("qwen3_5"):   # 4 layers: 3 Gated DeltaNet, 1 full attention with its output gate
        return build_hybrid_checkpoint(path, hybrid_moe_config() if "moe" in request.param else hybrid_config(),
                                       std=0.1)
    if request.param == "qwen3_next":         # its grouped projections; a shared expert beside the experts
        return build_hybrid_checkpoint(path, qwen3_next_config(), std=0.1)
    config = tiny_config(num_hidden_layers=2) if request.param == "qwen3" else tiny_moe_config(num_hidden_layers=2)
    return build_hf_checkpoint(path, config, save_dtype="float32", std=0.1)


def float64_hf(model, llm, monkeypatch, hybrid=False):
    """HF's model computing in float64 throughout: its RMSNorm and router cast to float32 on purpose (in a
    float64 model too), so for the float64 comparison those two steps keep the input's dtype; attention by
    torch's sdpa, which computes in the input's dtype (the eager softmax also casts to float32). Both compute
    RoPE's cos/sin in float32, where torch's and NumPy's cos differ by an ulp (6e-8) here and there: HF's
    rotary module returns npqwen's tables (inputs, not differentiated). The hybrid models cast to float32 in
    many more places (norms, gated norm, decay, the delta rule's chunks, the router's softmax): while HF runs,
    a tensor's `.float()`, `.to(torch.float32)` and a softmax's dtype=torch.float32 keep float64."""
    if hybrid:
        to, softmax = torch.Tensor.to, torch.nn.functional.softmax

        def float64(fn):   # fn with torch.float32 asked for, positionally or as dtype=, made torch.float64
            def wrapped(x, *args, **kwargs):
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
                if kwargs.get("dtype") is torch.float32:
                    kwargs["dtype"] = torch.float64
                return fn(x, *args, **kwargs)
            return wrapped
        monkeypatch.setattr(torch.Tensor, "float", torch.Tensor.double)
        monkeypatch.setattr(torch.Tensor, "to", float64(to))
        monkeypatch.setattr(torch.nn.functional, "softmax", float64(softmax))
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def router(self, x):
        logits = torch.nn.functional.linear(x.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True) if self.norm_topk_prob else top), index

    for cls in (modeling_qwen3.Qwen3RMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm):
        monkeypatch.setattr(cls, "forward", norm)
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", router)
    model.config._attn_implementation = "sdpa"
    model.config._experts_implementation = "eager"   # (grouped_mm takes no float64)
    m = llm.model

    def rotary(x, position_ids):
        positions = position_ids.reshape(-1, position_ids.shape[-1])[0].numpy()   # (Qwen3.5: 3 equal rows)
        cos, sin = ops.rope_cos_sin(m.inv_freq, positions, m.rope_scale, np.float64)
        return torch.from_numpy(cos)[None], torch.from_numpy(sin)[None]
    monkeypatch.setattr(model.model.rotary_emb, "forward", rotary)
    return model.to(torch.float64)


def hf_gradients(model, ids, target: int, gated: bool = False):
    """HF's gradients of log p(target) at the last position: each parameter's, and each module output's
    (and the inputs of o_proj and post_attention_layernorm: npqwen's attn_output and attn_residual)."""
    kept, handles = {}, []

    def keep(name, t):
        if t.requires_grad:   # (not Qwen4-Exp's indexer: a boolean selection)
            t.retain_grad()
            kept[name] = t

    for name, module in model.named_modules():
        short = name
        if name.endswith(".mlp.gate"):   # the router returns (logits, weights, index)
            def router(m, a, out, n=short):   # (a forward hook that returns nothing leaves the output)
                keep(n, out[0])
                keep(n + ".top_k_weights", out[1])
            handles.append(module.register_forward_hook(router))
        elif name.endswith((".o_proj", ".post_attention_layernorm", "linear_attn.norm")):
            inner = short.replace("o_proj", "attn_output").replace("post_attention_layernorm", "attn_residual") \
                .replace("linear_attn.norm", "linear_attn.core_attn_out")
            if "attn_output" not in inner or not gated:   # Qwen3.5 gates attn_output before o_proj
                handles.append(module.register_forward_pre_hook(lambda m, a, n=inner: keep(n, a[0])))
        if name and not name.endswith((".mlp.gate", ".rotary_emb", ".layers")) and name != "model":
            handles.append(module.register_forward_hook(
                lambda m, a, out, n=short: keep(n, out if torch.is_tensor(out) else out[0])))
    logits = model(torch.tensor([ids])).logits[0]
    value = torch.log_softmax(logits[-1], -1)[target]
    value.backward()
    for h in handles:
        h.remove()
    params = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return value.item(), params, {n: t.grad.numpy()[0] if t.grad.shape[0] == 1 else t.grad.numpy()
                                  for n, t in kept.items() if t.grad is not None}


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-10), ("float32", 1e-5)])
def test_every_gradient_equals_hf_backward(checkpoint, dtype, tolerance, monkeypatch):
    hybrid = "qwen3_5" in checkpoint.name or "qwen3_next" in checkpoint.name
    if dtype == "float64" and checkpoint.name.startswith(("qwen3_5_moe", "qwen3_next")):
        pytest.skip("5 s each; measured: within 2.6e-13 of HF float64 (Qwen3-Next's last shared_expert_gate, a sum "
                    "that cancels to 3e-6, 1.4e-10); test_hybrid_mixtures_equal_finite_differences checks them")
    hf, llm = (hf_hybrid_model if hybrid else hf_model)(checkpoint), npqwen.load(checkpoint, dtype=dtype)
    if dtype == "float64":
        hf = float64_hf(hf, llm, monkeypatch, hybrid)
    target = 42
    ours = grad.gradients(llm, IDS, grad.log_prob(target))
    value, params, activations = hf_gradients(hf, IDS, target, gated=hybrid)
    print(f"{dtype}: log p = {ours.value:.10f} (HF {value:.10f})")
    assert abs(ours.value - value) < tolerance * 10
    worst = []
    for name, g in params.items():   # every parameter of HF's model
        worst.append((rel(ours[name], g), name))
    compared = [n for n in activations if n in ours]
    assert len(compared) >= 14 * llm.config.num_hidden_layers, sorted(set(activations) - set(ours))
    for name in compared:
        worst.append((rel(np.reshape(ours[name], activations[name].shape), activations[name]), name))
    worst.sort(reverse=True)
    print(f"{len(params)} weights and {len(compared)} activations; the largest relative differences:", worst[:4])
    if hybrid and dtype == "float32":   # the delta rule rounds: HF's own gradients are 2e-5 to 4e-5 from float64's
        exact = grad.gradients(npqwen.load(checkpoint, dtype="float64"), IDS, grad.log_prob(target))
        errors = {n: (rel(ours[n], exact[n]), rel(g, exact[n])) for n, g in params.items()}   # (npqwen's, HF's)
        ours_error, hf_error = (max(e[k] for e in errors.values()) for k in (0, 1))
        print(f"from float64's gradients: npqwen float32 {ours_error:.1e}, HF float32 {hf_error:.1e}")
        # each weight's gradient within 5e-5 of float64's, or at most 3x as far as HF's own float32 one is (a
        # gradient that nearly cancels, such as Qwen3-Next's last shared_expert_gate here, is far from it in both)
        assert ours_error < hf_error and all(mine <= max(3 * hf, 5e-5) for mine, hf in errors.values()), \
            sorted(((m, h, n) for n, (m, h) in errors.items() if m > max(3 * h, 5e-5)), reverse=True)[:3]
    else:
        assert worst[0][0] < tolerance, worst[:4]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-qwen3.5", "tiny-qwen4-exp"])
def test_whole_model_equals_finite_differences(name):
    """Every weight (one element of each, chosen at random; Qwen4-Exp: 24 of its 155 weights) and a few activations
    (nudged by a hook) of the built-in tiny models in float64: d loss by central differences against npqwen's
    backward."""
    whole_model_finite_differences(npqwen.load(name, dtype="float64"), name,
                                   sample=24 if name == "tiny-qwen4-exp" else None)


def test_hybrid_mixtures_equal_finite_differences(checkpoint):
    """The same for Qwen3.5-MoE and Qwen3-Next (shared experts; Qwen3-Next's grouped projections)."""
    if not checkpoint.name.startswith(("qwen3_5_moe", "qwen3_next")):
        pytest.skip("the built-in models cover the others")
    whole_model_finite_differences(npqwen.load(checkpoint, dtype="float64"), checkpoint.name, sample=24)


def whole_model_finite_differences(llm, name, sample=None):
    """d loss by the five-point stencil (error of order eps^4) against npqwen's backward, relative to the
    largest value of each gradient; `sample`: that many weights, chosen at random, in place of all."""
    rng, eps = np.random.default_rng(1), 1e-4
    ids = [5, 17, 33, 2, 101, 7, 64, 250, 9]
    ours = grad.gradients(llm, ids, grad.loss())

    def loss(hooks=None):
        return ops.cross_entropy(llm.run_with_hooks(ids, hooks or {}), grad.next_tokens(ids))

    def slope(f):   # f(h): the loss with the number moved by h
        return (8 * (f(eps) - f(-eps)) - (f(2 * eps) - f(-2 * eps))) / (12 * eps)

    worst = []
    names = ours.weight_names if sample is None else rng.choice(ours.weight_names, sample, replace=False).tolist()
    for w in names:
        array = llm.model.weights.get(w, llm.model.fused.get(w))
        idx = tuple(int(rng.integers(s)) for s in array.shape)
        old = array[idx]

        def moved(h, array=array, idx=idx, old=old):
            array[idx] = old + h
            value = loss()
            array[idx] = old
            return value
        worst.append((abs(slope(moved) - ours[w][idx]) / max(np.abs(ours[w]).max(), 1e-12), w))
    layer, cfg = llm.config.num_hidden_layers - 1, llm.config
    mlp = "experts" if cfg.is_moe_layer(layer) else "down_proj"
    for a in ("model.embed_tokens", grad.block_inputs(cfg, 0)[0], f"model.layers.{layer}.mlp.{mlp}",
              f"model.layers.{layer}.attn_residual", "model.hyper_connection_mixer" if cfg.qwen4_exp else "model.norm"):
        def nudged(h, a=a):   # position 3, value 5 of activation a moved by h, with a hook
            def hook(x, n):
                x = x.copy()
                x[3, 5] += h
                return x
            return loss({a: hook})
        worst.append((abs(slope(nudged) - ours[a][3, 5]) / np.abs(ours[a]).max(), a))
    worst.sort(reverse=True)
    print(f"{name}: {len(names)} weights, 5 activations; worst relative differences {worst[:3]}")
    assert worst[0][0] < 1e-6, worst[:3]


def test_the_tape_changes_no_logit_and_names_are_step_names():
    llm = npqwen.load("tiny")
    g = grad.gradients(llm, IDS[:6], grad.logit_diff(3, 4), weights=False)
    assert np.array_equal(g.logits, llm.forward(IDS[:6]))
    assert set(g.activations()) <= set(step_names(llm.config)) and not g.weight_names
    assert g.value == pytest.approx(float(g.logits[-1, 3] - g.logits[-1, 4]))
    with pytest.raises(npqwen.NpqwenError, match="no gradient named 'model.layers.0.mlp.act_fm'; did you mean "
                                                 "model.layers.0.mlp.act_fn"):
        g["model.layers.0.mlp.act_fm"]
    with pytest.raises(npqwen.NpqwenError, match="weights=False"):
        g["model.norm.weight"]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-qwen3.5", "tiny-qwen4-exp"])
def test_activation_checkpointing_gives_the_same_gradients(name):
    """Only the residual stream kept going forward, each layer run again before its backward: every gradient bit
    for bit the same (the same code runs), with a fraction of the tape."""
    llm, ids = npqwen.load(name), IDS[:9]
    whole = grad.gradients(llm, ids, grad.loss())
    saved = grad.gradients(llm, ids, grad.loss(), checkpoint=True)
    assert set(whole) == set(saved) and all(np.array_equal(whole[n], saved[n]) for n in whole)
    print(f"{name}: {len(saved.tape)} arrays kept of {len(whole.tape)}")
    assert len(saved.tape) <= llm.config.num_hidden_layers + 5


# -- Qwen4-Exp: hyper-connections, QSA, PLE, with Gated DeltaNet and the gated shared expert MoE --

@pytest.fixture(scope="module")
def qwen4_exp(tmp_path_factory):
    from test_qwen4_exp import build

    return build(tmp_path_factory.mktemp("qwen4_exp"))[0]   # 4 layers: DeltaNet x3 (2 with PLE), QSA; C=3 streams


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-10), ("float32", 1e-5)])
def test_qwen4_exp_gradients_equal_hf_backward(qwen4_exp, dtype, tolerance, monkeypatch):
    """Every weight's gradient and every module output's HF has against transformers' backward, the rules above.
    QSA's indexer reaches the output only through its boolean selection: HF leaves its weights' .grad None, npqwen
    gives zeros. The PLE tables are frozen in npqwen: their gradient is checked as the looked-up rows' (HF's table
    gradient is those rows' gradients added at their ids)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

    llm = npqwen.load(qwen4_exp, dtype=dtype)
    hf = Qwen4ExpForCausalLM.from_pretrained(qwen4_exp, dtype=torch.float32).eval()
    hf.config._experts_implementation = "eager"   # (grouped_mm takes no float64)
    if dtype == "float64":
        hf = float64_hf(hf, llm, monkeypatch, hybrid=True)
    ids, target, cfg = IDS[:-1] + [7, 9, 299, 11, 23, 7], 42, llm.config   # 17 tokens: QSA's budget (8) leaves some out
    ours = grad.gradients(llm, ids, grad.log_prob(target))
    value, params, activations = hf_gradients(hf, ids, target, gated=True)
    left_out = (~ours.tape["model.layers.3.self_attn.indexer"]).sum() - len(ids) * (len(ids) - 1) // 2
    print(f"{dtype}: log p = {ours.value:.10f} (HF {value:.10f}); QSA left out {left_out} visible positions")
    assert abs(ours.value - value) < tolerance * 10 and left_out > 0
    indexer = {n for n in ours.weight_names if ".indexer." in n}
    tables = {n for n, _ in hf.named_parameters() if "ngram_embedding" in n}
    assert indexer and not indexer & set(params) and all(not ours[n].any() for n in indexer)
    views = {n for n in ours.weight_names if re.search(r"\.experts\.\d", n)}   # the per-expert names, views
    assert set(ours.weight_names) - indexer - views == set(params) - tables
    worst = sorted(((rel(ours[n], g), n) for n, g in params.items() if n not in tables), reverse=True)
    compared = [n for n in activations if n in ours]
    for name in compared:
        worst.append((rel(np.reshape(ours[name], activations[name].shape), activations[name]), name))
    for i in (i for i in range(cfg.num_hidden_layers) if cfg.is_ple_layer(i)):   # the tables: the rows looked up
        j, Hn = cfg.ple_index(i), (cfg.ngram_size - 1) * cfg.heads_per_ngram
        sizes, offsets = ple.head_vocab_sizes(cfg.ngram_vocab_size_base, Hn, j)
        rows = ple.ngram_ids(np.array([7, 7] + ids), ple.layer_multipliers(cfg.vocab_size, 3, j, cfg.seed), sizes,
                             offsets, cfg.heads_per_ngram, 7)[2:]                          # (T, Hn)
        name = f"model.layers.{i}.ple.ple_embedding.ngram_embedding.weight"
        table = np.zeros(params[name].shape)
        np.add.at(table, rows, np.reshape(ours[f"model.layers.{i}.ple.ple_embedding"], (len(ids), Hn, -1)))
        worst.append((rel(table, params[name]), name))
    worst.sort(reverse=True)
    print(f"{len(params)} weights and {len(compared)} activations; the largest relative differences:", worst[:4])
    assert len(compared) >= 14 * cfg.num_hidden_layers, sorted(set(activations) - set(ours))
    if dtype == "float32":   # each weight's within 5e-5 of float64's, or at most 3x as far as HF's own float32 one
        exact = grad.gradients(npqwen.load(qwen4_exp, dtype="float64"), ids, grad.log_prob(target))
        errors = {n: (rel(ours[n], exact[n]), rel(g, exact[n])) for n, g in params.items() if n not in tables}
        ours_error, hf_error = (max(e[k] for e in errors.values()) for k in (0, 1))
        print(f"from float64's gradients: npqwen float32 {ours_error:.1e}, HF float32 {hf_error:.1e}")
        assert all(mine <= max(3 * hf, 5e-5) for mine, hf in errors.values()), \
            sorted(((m, h, n) for n, (m, h) in errors.items() if m > max(3 * h, 5e-5)), reverse=True)[:3]
    else:
        assert worst[0][0] < tolerance, worst[:4]
