"""Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next, as small functions over arrays.

A linear-attention layer keeps no keys and values. Its memory of the past is one matrix per value
head, the state S (dk, dv): a token's query reads it (o = S^T q), and each token writes to it with
the delta rule: the state first decays by exp(g), then what it already stores at key k (S^T k) is
moved toward the token's value v by the write strength beta:

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

So the state stays (dk, dv) however long the context grows. Before that, q, k and v pass through a
short causal depthwise convolution (kernel 4) with SiLU, whose state is the last 3 inputs; q and k
are L2-normalised and q is scaled by dk^-1/2. After it, a gated RMSNorm (by SiLU(z)) and out_proj.

Two forms compute the same outputs and final state (tests/test_linear_attention.py checks it):
`recurrent_gated_delta_rule` applies the update token by token (decode: one token per sequence, all
sequences of a batch in one update); `chunked_gated_delta_rule` takes 64 tokens at a time with
matrix products and one triangular solve per chunk (prefill), as HF's torch_chunk_gated_delta_rule.

Shapes: T tokens, B sequences, C = 2*Hk*dk + Hv*dv convolved channels, W conv kernel, Hk key heads
of dk, Hv value heads of dv (Hv a multiple of Hk: value head h reads key head h // (Hv/Hk)).
Qwen3.5-0.8B: Hk=16, dk=128, Hv=16, dv=128, W=4.
The delta rule runs in (at least) float32, as HF runs it, whatever the weights' dtype.

Each function's backward follows it (npqwen/grad.py chains them): the gradient of a scalar with respect to
the function's outputs in, the gradients with respect to its inputs out. The delta rule's is the recurrent
form's, token by token in reverse, from the states the forward passes through (kept: T states of
(Hv, dk, dv)); the chunked form computes the same function, so it has the same gradients.
"""
import numpy as np

from .backend import xp_of
from .ops import rms_norm_backward, sigmoid, sigmoid_backward, silu, silu_backward

CHUNK = 64   # tokens per chunk of the chunked form (HF's and flash-linear-attention's chunk_size)


def causal_conv1d(x, weight, state):
    """Depthwise causal convolution with SiLU over each sequence's previous W-1 inputs (its state):
    x (B, T, C), weight (C, W), state (B, W-1, C) -> out (B, T, C), new state (B, W-1, C)."""
    xp, T, W = xp_of(x), x.shape[1], weight.shape[1]
    padded = xp.concatenate([state.astype(x.dtype), x], axis=1)              # (B, W-1+T, C)
    out = padded[:, 0:T] * weight[:, 0]                                      # (B, T, C)
    for j in range(1, W):          # out[t] = sum_j weight[:, j] * input[t - (W-1) + j]
        out += padded[:, j:j + T] * weight[:, j]
    return silu(out), padded[:, T:]                                          # the last W-1 inputs


def causal_conv1d_backward(d_out, x, weight, state):
    """d_out (B, T, C) -> d_x (B, T, C), d_weight (C, W), d_state (B, W-1, C) (the gradient of the new state
    is not taken: a forward from position 0 starts from zeros and its last state feeds nothing here)."""
    xp, T, W = xp_of(x), x.shape[1], weight.shape[1]
    padded = xp.concatenate([state.astype(x.dtype), x], axis=1)              # (B, W-1+T, C)
    pre = padded[:, 0:T] * weight[:, 0]
    for j in range(1, W):
        pre += padded[:, j:j + T] * weight[:, j]                             # (B, T, C) before the SiLU
    d_pre = silu_backward(d_out, pre)
    d_padded = xp.zeros_like(padded)
    d_weight = xp.empty_like(weight)
    for j in range(W):             # out[t] += weight[:, j] * input[t - (W-1) + j]
        d_padded[:, j:j + T] += d_pre * weight[:, j]
        d_weight[:, j] = (d_pre * padded[:, j:j + T]).sum(axis=(0, 1))
    return d_padded[:, W - 1:], d_weight, d_padded[:, :W - 1]


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis (flash-linear-attention's l2norm)."""
    xp = xp_of(x)
    return x / xp.sqrt((x * x).sum(-1, keepdims=True) + eps)


def l2norm_backward(d_y, x, eps: float = 1e-6):
    """y = x / n, n = sqrt(sum x^2 + eps): d_x = d_y / n - x sum(d_y x) / n^3."""
    n = xp_of(x).sqrt((x * x).sum(-1, keepdims=True) + eps)
    return d_y / n - x * ((d_y * x).sum(-1, keepdims=True) / n ** 3)


def delta_rule_step(q, k, v, g, beta, state):
    """One token of every sequence: q, k (B, Hv, dk), v (B, Hv, dv), g, beta (B, Hv), state (B, Hv, dk, dv)
    -> output (B, Hv, dv), new state (B, Hv, dk, dv)."""
    xp = xp_of(q)
    state = state * xp.exp(g)[..., None, None]                               # decay
    stored = xp.einsum("bhkv,bhk->bhv", state, k)                            # what the state holds at k
    delta = (v - stored) * beta[..., None]                                   # (B, Hv, dv) the correction
    state = state + k[..., :, None] * delta[..., None, :]                    # write it at k
    return xp.einsum("bhkv,bhk->bhv", state, q), state                       # read by q


def delta_rule_step_backward(d_out, d_new_state, q, k, v, g, beta, state):
    """One token backward, given the state before it: d_out (B, Hv, dv), d_new_state (B, Hv, dk, dv) ->
    d_q, d_k (B, Hv, dk), d_v (B, Hv, dv), d_g, d_beta (B, Hv), d_state (B, Hv, dk, dv)."""
    xp = xp_of(q)
    decayed = state * xp.exp(g)[..., None, None]                             # A = exp(g) S
    stored = xp.einsum("bhkv,bhk->bhv", decayed, k)                          # A^T k
    delta = (v - stored) * beta[..., None]
    new = decayed + k[..., :, None] * delta[..., None, :]                    # S' = A + k delta^T
    d_new = d_new_state + q[..., :, None] * d_out[..., None, :]              # o = S'^T q
    d_q = xp.einsum("bhkv,bhv->bhk", new, d_out)
    d_delta = xp.einsum("bhkv,bhk->bhv", d_new, k)                           # (B, Hv, dv)
    d_stored = -d_delta * beta[..., None]
    d_k = xp.einsum("bhkv,bhv->bhk", d_new, delta) + xp.einsum("bhkv,bhv->bhk", decayed, d_stored)
    d_v = d_delta * beta[..., None]
    d_beta = (d_delta * (v - stored)).sum(-1)
    d_decayed = d_new + k[..., :, None] * d_stored[..., None, :]             # (B, Hv, dk, dv)
    d_g = (d_decayed * decayed).sum(axis=(-2, -1))                           # dA/dg = A
    return d_q, d_k, d_v, d_g, d_beta, d_decayed * xp.exp(g)[..., None, None]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """The delta rule token by token: q, k (B, T, Hv, dk) normalised and scaled, v (B, T, Hv, dv), g, beta
    (B, T, Hv), state (B, Hv, dk, dv) -> outputs (B, T, Hv, dv), final state."""
    out = xp_of(q).empty(v.shape, dtype=state.dtype)
    for t in range(q.shape[1]):
        out[:, t], state = delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return out, state


def delta_rule_states(q, k, v, g, beta, state):
    """The delta rule token by token over one sequence, keeping the state after each token (speculative
    decoding rolls back to one of them): q, k (T, Hv, dk), v (T, Hv, dv), g, beta (T, Hv), state (Hv, dk, dv)
    -> outputs (T, Hv, dv), states (T, Hv, dk, dv). The same step as decoding, one token at a time."""
    xp, T = xp_of(q), q.shape[0]
    out = xp.empty(v.shape, dtype=state.dtype)                               # (T, Hv, dv)
    states = xp.empty((T, *state.shape), dtype=state.dtype)                  # (T, Hv, dk, dv)
    s = state[None]                                                          # (1, Hv, dk, dv)
    for t in range(T):
        o, s = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        out[t], states[t] = o[0], s[0]
    return out, states


def recurrent_gated_delta_rule_backward(d_out, q, k, v, g, beta, state):
    """d_out (B, T, Hv, dv) -> d_q, d_k, d_v, d_g, d_beta (shapes of the inputs) and d_state (B, Hv, dk, dv) of
    the initial state: the forward again, keeping the state before each token, then the tokens in reverse."""
    T = q.shape[1]
    states = []
    for t in range(T):
        states.append(state)
        state = delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)[1]
    d_state = xp_of(q).zeros_like(state)
    grads = [xp_of(q).zeros(a.shape, dtype=state.dtype) for a in (q, k, v, g, beta)]
    for t in reversed(range(T)):
        *d_t, d_state = delta_rule_step_backward(d_out[:, t], d_state, q[:, t], k[:, t], v[:, t], g[:, t],
                                                 beta[:, t], states[t])
        for d_all, d in zip(grads, d_t):
            d_all[:, t] = d
    return (*grads, d_state)


def solve_unit_lower(A, B):
    """X with (I + strictly_lower(A)) X = B, by forward substitution over the rows: A (..., C, C), B (..., C, d)."""
    xp = xp_of(A)
    X = xp.empty_like(B)
    X[..., 0, :] = B[..., 0, :]
    for i in range(1, A.shape[-1]):
        X[..., i, :] = B[..., i, :] - xp.einsum("...j,...jd->...d", A[..., i, :i], X[..., :i, :])
    return X


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The delta rule over one sequence, `chunk` tokens at a time: q, k (T, Hv, dk) normalised and scaled,
    v (T, Hv, dv), g, beta (T, Hv), state (Hv, dk, dv) -> outputs (T, Hv, dv), final state.

    Within a chunk, the token-by-token writes W_t = beta_t (v_t - S_t^T k_t) depend on each other only
    through earlier tokens of the chunk, so all of them solve one unit lower-triangular system; the
    state is then read and written once per chunk. Exactly HF's torch_chunk_gated_delta_rule."""
    xp, T = xp_of(q), q.shape[0]
    pad = -T % chunk
    q, k, v, g, beta = (xp.concatenate([a, xp.zeros((pad, *a.shape[1:]), a.dtype)]) for a in (q, k, v, g, beta))
    N = (T + pad) // chunk
    # heads first, then chunks: (Hv, N, c, d)
    q, k, v = (a.reshape(N, chunk, *a.shape[1:]).transpose(2, 0, 1, 3) for a in (q, k, v))
    g, beta = (a.reshape(N, chunk, -1).transpose(2, 0, 1) for a in (g, beta))       # (Hv, N, c)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = xp.cumsum(g, axis=-1)                                             # (Hv, N, c) log of the decay since the chunk began
    lower = xp.tril(xp.ones((chunk, chunk), dtype=bool))                    # token i sees tokens j <= i
    decay = xp.exp(xp.where(lower, cum[..., :, None] - cum[..., None, :], -np.inf))   # (Hv, N, c, c)
    # the writes of a chunk: (I + strictly_lower(beta k k^T decay)) u = beta v, and the same for the old state's reads
    system = (k_beta @ k.transpose(0, 1, 3, 2)) * decay                         # (Hv, N, c, c)
    u = solve_unit_lower(system, v_beta)                                    # (Hv, N, c, dv)
    w = solve_unit_lower(system, k_beta * xp.exp(cum)[..., None])           # (Hv, N, c, dk)
    attn = (q @ k.transpose(0, 1, 3, 2)) * decay                                # (Hv, N, c, c) causal, decayed q.k
    q_decayed = q * xp.exp(cum)[..., None]                                  # q reads the state as it was at the chunk's start
    k_decayed = k * xp.exp(cum[..., -1:] - cum)[..., None]                  # a write decays until the chunk's end
    chunk_decay = xp.exp(cum[..., -1])[..., None, None]                     # (Hv, N, 1, 1)
    out = xp.empty(v.shape, dtype=state.dtype)                              # (Hv, N, c, dv)
    for n in range(N):
        v_new = u[:, n] - w[:, n] @ state                                   # (Hv, c, dv) the corrections written
        out[:, n] = q_decayed[:, n] @ state + attn[:, n] @ v_new
        state = state * chunk_decay[:, n] + k_decayed[:, n].transpose(0, 2, 1) @ v_new   # (Hv, dk, dv)
    return out.transpose(1, 2, 0, 3).reshape(N * chunk, -1, v.shape[-1])[:T], state


def gated_rms_norm(x, z, weight, eps: float, gate=silu):
    """RMSNorm of each head's output, times weight, times SiLU(z) (Qwen4-Exp's output_gate_type may say sigmoid):
    x, z (..., dv), weight (dv,)."""
    xp, f32 = xp_of(x), np.promote_types(x.dtype, np.float32)
    xf = x.astype(f32, copy=False)
    y = xf / xp.sqrt((xf * xf).sum(-1, keepdims=True) / x.shape[-1] + eps)
    return (weight * y.astype(x.dtype) * gate(z.astype(f32))).astype(x.dtype)


def gated_rms_norm_backward(d_y, x, z, weight, eps: float, gate=silu):
    """y = rms_norm(x) * weight * gate(z), gate silu or sigmoid: d_x, d_z (..., dv), d_weight (dv,)."""
    gate_backward = sigmoid_backward if gate is sigmoid else silu_backward
    d_x, d_weight = rms_norm_backward(d_y * gate(z), x, weight, eps)        # the norm's output scaled by gate(z)
    xp = xp_of(x)
    normed = x / xp.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return d_x, gate_backward(d_y * weight * normed, z), d_weight


def decay_and_beta(a, b, A_log, dt_bias):
    """The per-token, per-value-head decay g = -exp(A_log) softplus(a + dt_bias) (log space, <= 0) and the
    write strength beta = sigmoid(b): a, b (T, Hv) -> g, beta (T, Hv) float32."""
    xp, f32 = xp_of(a), np.promote_types(a.dtype, np.float32)
    s = a.astype(f32) + dt_bias.astype(f32)
    softplus = xp.where(s > 20, s, xp.log1p(xp.exp(xp.minimum(s, 20))))      # torch's softplus (threshold 20)
    g = -xp.exp(A_log.astype(f32)) * softplus
    beta = 1.0 / (1.0 + xp.exp(-b.astype(f32)))
    return g, beta


def decay_and_beta_backward(d_g, d_beta, a, b, A_log, dt_bias):
    """d_g, d_beta (T, Hv) -> d_a, d_b (T, Hv), d_A_log, d_dt_bias (Hv,). softplus' = sigmoid (1 past torch's
    threshold, where softplus is the identity); g = -exp(A_log) softplus(s), so dg/dA_log = g."""
    xp = xp_of(a)
    s = a + dt_bias
    softplus = xp.where(s > 20, s, xp.log1p(xp.exp(xp.minimum(s, 20))))
    d_s = d_g * -xp.exp(A_log) * xp.where(s > 20, 1.0, sigmoid(s))          # (T, Hv)
    d_A_log = (d_g * -xp.exp(A_log) * softplus).sum(axis=0)                  # (Hv,)
    beta = sigmoid(b)
    return d_s, d_beta * beta * (1.0 - beta), d_A_log, d_s.sum(axis=0)


def queries_keys_values(mixed, Hk, dk, Hv, dv):
    """Split the convolved (T, C) into q, k (T, Hv, dk), L2-normalised, q scaled by dk^-1/2, and v (T, Hv, dv);
    each key head is repeated for the Hv/Hk value heads that read it."""
    T, xp, f32 = mixed.shape[0], xp_of(mixed), np.promote_types(mixed.dtype, np.float32)
    q = mixed[:, :Hk * dk].reshape(T, Hk, dk).astype(f32)
    k = mixed[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk).astype(f32)
    v = mixed[:, 2 * Hk * dk:].reshape(T, Hv, dv).astype(f32)
    if Hv != Hk:
        q, k = xp.repeat(q, Hv // Hk, axis=1), xp.repeat(k, Hv // Hk, axis=1)   # (T, Hv, dk): 0,0,1,1,...
    return l2norm(q) * (dk ** -0.5), l2norm(k), v


def queries_keys_values_backward(d_q, d_k, d_v, mixed, Hk, dk, Hv, dv):
    """d_q, d_k (T, Hv, dk), d_v (T, Hv, dv) -> d_mixed (T, C): through the scale, the L2 norms, the repeat of each
    key head for its Hv/Hk value heads (their gradients summed) and the split."""
    T, xp = mixed.shape[0], xp_of(mixed)
    q = mixed[:, :Hk * dk].reshape(T, Hk, dk)
    k = mixed[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
    d_q = d_q * (dk ** -0.5)                                                 # q was scaled after its norm
    if Hv != Hk:   # value heads 0,0,1,1,...: each key head's gradient is the sum over its copies
        d_q, d_k = (d.reshape(T, Hk, Hv // Hk, dk).sum(axis=2) for d in (d_q, d_k))
    d_q, d_k = l2norm_backward(d_q, q), l2norm_backward(d_k, k)
    return xp.concatenate([d_q.reshape(T, -1), d_k.reshape(T, -1), d_v.reshape(T, -1)], axis=1)


def ungroup_qwen3_next(qkvz, ba, Hk, dk, Hv, dv):
    """Qwen3-Next's two projections, whose rows come grouped by key head ([q, k, v, z] and [b, a] of each), as
    Qwen3.5's four: qkv (T, C) with every q, then every k, then every v; z (T, Hv*dv); b, a (T, Hv)."""
    T, r = qkvz.shape[0], Hv // Hk                                          # r value heads per key head
    g = qkvz.reshape(T, Hk, 2 * dk + 2 * r * dv)
    q, k, v, z = g[..., :dk], g[..., dk:2 * dk], g[..., 2 * dk:2 * dk + r * dv], g[..., 2 * dk + r * dv:]
    qkv = xp_of(qkvz).concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1)
    ba = ba.reshape(T, Hk, 2 * r)
    return qkv, z.reshape(T, Hv * dv), ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)


def ungroup_qwen3_next_backward(d_qkv, d_z, d_b, d_a, Hk, dk, Hv, dv):
    """The gradients of ungroup_qwen3_next's four outputs put back in its inputs' grouped order:
    d_qkvz (T, Hk*(2dk + 2r*dv)), d_ba (T, 2Hv). (A reordering: its backward is the reverse reordering.)"""
    T, r, xp = d_qkv.shape[0], Hv // Hk, xp_of(d_qkv)
    q, k = d_qkv[:, :Hk * dk].reshape(T, Hk, dk), d_qkv[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk)
    v, z = d_qkv[:, 2 * Hk * dk:].reshape(T, Hk, r * dv), d_z.reshape(T, Hk, r * dv)
    d_qkvz = xp.concatenate([q, k, v, z], axis=-1).reshape(T, -1)            # each key head's [q, k, v, z]
    d_ba = xp.concatenate([d_b.reshape(T, Hk, r), d_a.reshape(T, Hk, r)], axis=-1).reshape(T, -1)   # [b, a]
    return d_qkvz, d_ba
