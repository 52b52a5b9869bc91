"""Attribution graphs through transcoders: circuit-tracer's method (Ameisen et al. 2025, "Circuit Tracing"), in NumPy.

    tcs = [npqwen.load_sae(f"transcoders/layer_{l}.safetensors", llm.config) for l in range(L)]
    graph = circuits.attribution_graph(llm, "The capital of France is", tcs)
    circuits.save_graph_files(graph, llm, "graphs/", slug="france")     # circuit-tracer's viewer opens it

The local replacement model: each MLP is replaced by its transcoder's features plus an error node (what the
transcoder misses, a constant), and the attention patterns and every RMSNorm's 1/rms are frozen at their values
on this prompt. What is left is linear in the residual stream, so the direct effect of a source node s on a
target node t is a dot product:

    A[t, s] = (d target / d residual where s writes) . (what s writes)

sources: an active feature (layer l, position p) writes a * W_dec[f] at layer l's MLP output; an error node
(l, p) writes the MLP output minus the transcoder's; a token writes its embedding. Targets: a feature's
pre-activation reads W_enc[:, f] . post_attention_layernorm(h) at layer l's MLP input; a logit node is one of the
likeliest next tokens, read as its demeaned lm_head row . norm(h) at the last position. One linear backward
pass per batch of targets (the residual stream, and through each frozen attention the value and output
projections only) gives a batch of rows. The graph is then pruned by influence on the logits and written in
circuit-tracer's JSON (create_graph_files: metadata, qParams, nodes, links).

Node order, as circuit-tracer's Graph: [active features (by layer, position, feature), error nodes (layer-major,
L * T), tokens (T), logits]; adjacency rows are targets, columns sources.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backend import to_numpy
from .errors import NpqwenError
from .features import SAE, decode, encode


@dataclass
class Graph:
    prompt: str
    input_tokens: list[int]          # (T,)
    active_features: np.ndarray      # (n, 3) layer, position, feature
    activation_values: np.ndarray    # (n,)
    adjacency: np.ndarray            # (N, N) float32, rows targets, columns sources; N = n + L*T + T + n_logits
    logit_tokens: np.ndarray         # (n_logits,) token ids, likeliest first
    logit_probabilities: np.ndarray  # (n_logits,)
    n_layers: int
    transcoders: list                # one SAE (a transcoder) per layer
    decode: object = str             # token id -> its text (the tokenizer's; str of the id without one)

    @property
    def n_pos(self) -> int:
        return len(self.input_tokens)


def salient_logits(logits_last, max_n_logits: int = 10, desired_logit_prob: float = 0.95):
    """The fewest likeliest tokens whose probabilities sum to desired_logit_prob, at most max_n_logits:
    (ids, probabilities), as circuit-tracer's compute_salient_logits."""
    z = logits_last.astype(np.float64)
    probs = np.exp(z - z.max())
    probs /= probs.sum()                                                          # (V,)
    top = np.argsort(-probs, kind="stable")[:max_n_logits]
    cutoff = int(np.searchsorted(np.cumsum(probs[top]), desired_logit_prob)) + 1
    return top[:cutoff], probs[top[:cutoff]]


def inv_rms(x, eps: float) -> np.ndarray:
    """1 / sqrt(mean(x^2) + eps) per row (T,): an RMSNorm's scale, frozen in the replacement model."""
    x = x.astype(np.float64)
    return (1.0 / np.sqrt((x * x).mean(-1) + eps)).astype(np.float32)


def attention_backward_frozen(g, probs, Wv, Wo, w_in, r_in, kv_heads: int):
    """The gradient (B, T, D) at a layer's input from g (B, T, D) at its attention's output, patterns (H, T, T)
    and input_layernorm's 1/rms frozen: only v_proj and o_proj carry it (queries and keys set the frozen pattern)."""
    B, T, _ = g.shape
    H = probs.shape[0]
    d_o = (g @ Wo).reshape(B, T, H, -1)                                           # (B, T, H, Dh)
    d_v = np.einsum("hts,bthd->bshd", probs, d_o)                                 # (B, T, H, Dh): p^T d_o per head
    d_v = d_v.reshape(B, T, kv_heads, H // kv_heads, -1).sum(3)                   # (B, T, K, Dh): GQA, heads 0,0,1,1
    d_a = d_v.reshape(B, T, -1) @ Wv                                              # (B, T, D)
    return d_a * w_in * r_in[:, None]                                             # frozen RMSNorm: times w / rms


def attribution_graph(llm, prompt, transcoders, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
                      batch_size: int = 256) -> Graph:
    """The direct-effect graph of `prompt`'s next-token logits through one transcoder per layer (see above)."""
    cfg, model = llm.config, llm.model
    L, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    if cfg.num_experts or cfg.hybrid or cfg.norm_offset:
        raise NpqwenError("attribution graphs run on dense Qwen3 models (no experts, no linear attention)")
    if len(transcoders) != L or not all(isinstance(t, SAE) and t.kind == "transcoder" for t in transcoders):
        raise NpqwenError(f"attribution_graph needs one transcoder per layer ({L}), from npqwen.load_sae, in order")
    for layer, tc in enumerate(transcoders):
        if tc.reads != f"model.layers.{layer}.post_attention_layernorm" or \
                tc.writes != f"model.layers.{layer}.mlp.down_proj":
            raise NpqwenError(f"transcoder {layer} ({tc.source}) reads {tc.reads} and writes {tc.writes}; a graph "
                              f"needs layer {layer}'s MLP input and output (circuit-tracer's mlp.hook_in, hook_out)")
    ids = llm.prompt_ids(prompt)
    T, D = len(ids), cfg.hidden_size
    logits, cache = llm.run_with_cache(ids, names=lambda n: n.startswith("model.embed_tokens") or any(
        n == f"model.layers.{i}{s}" for i in range(L) for s in ("", ".attn_residual", ".self_attn.attn_probs",
                                                                ".post_attention_layernorm", ".mlp.down_proj")))
    W = {k: to_numpy(v).astype(np.float32, copy=False) for k, v in model.weights.items()   # views, on the host
         if k.endswith(("v_proj.weight", "o_proj.weight", "layernorm.weight")) or k == "model.norm.weight"}
    unembed = to_numpy(model.lm_head_weight()).astype(np.float32, copy=False)      # (V, D)
    h_in = [cache["model.embed_tokens"]] + [cache[f"model.layers.{i}"] for i in range(L - 1)]   # each layer's input

    # 1. forward: each transcoder's active features and its error, the frozen scales and patterns
    feats, values, dec_vecs, enc_vecs, errors = [], [], [], [], []
    for layer, tc in enumerate(transcoders):
        x = cache[f"model.layers.{layer}.post_attention_layernorm"]               # (T, D) the MLP's input
        acts = encode(tc, x)                                                       # (T, F)
        errors.append(cache[f"model.layers.{layer}.mlp.down_proj"] - decode(tc, acts, x))   # (T, D)
        pos, f = np.nonzero(acts)                                                  # by position, then feature
        feats.append(np.stack([np.full_like(pos, layer), pos, f], 1))
        values.append(acts[pos, f])
        dec_vecs.append(acts[pos, f, None] * tc.W_dec[f])                          # (n_l, D) a * W_dec[f]
        enc_vecs.append(tc.W_enc[:, f].T)                                          # (n_l, D) W_enc[:, f]
    active = np.concatenate(feats).astype(np.int64)                                # (n, 3)
    n = len(active)
    r_in = [inv_rms(h_in[i], eps) for i in range(L)]                               # (T,) each
    r_post = [inv_rms(cache[f"model.layers.{i}.attn_residual"], eps) for i in range(L)]
    r_final = inv_rms(cache[f"model.layers.{L - 1}"], eps)
    logit_ids, logit_probs = salient_logits(to_numpy(logits[-1]), max_n_logits, desired_logit_prob)
    demeaned = unembed[logit_ids] - unembed.mean(0, dtype=np.float64).astype(np.float32)   # (n_logits, D)

    # 2. targets: each active feature's encoder row at its layer's MLP input, then each logit at the last token
    err0, tok0 = n, n + L * T
    logit0 = tok0 + T
    N = logit0 + len(logit_ids)
    targets = [("feature", int(a[0]), int(a[1]), v) for a, v in zip(active, np.concatenate(enc_vecs))]
    targets += [("logit", L, T - 1, v) for v in demeaned]
    rows = list(range(n)) + list(range(logit0, N))
    adjacency = np.zeros((N, N), np.float32)
    starts = np.cumsum([0] + [len(v) for v in values])                             # each layer's first feature
    embeds = cache["model.embed_tokens"].astype(np.float32)                        # (T, D)

    # 3. a linear backward per batch of targets, from the top layer down
    for b0 in range(0, len(targets), batch_size):
        batch, out = targets[b0:b0 + batch_size], rows[b0:b0 + batch_size]
        B = len(batch)
        g = np.zeros((B, T, D), np.float32)                                        # d targets / d residual stream
        for j, (kind, layer, pos, v) in enumerate(batch):   # logits read norm(h) at the top: frozen 1/rms
            if kind == "logit":
                g[j, pos] += v * W["model.norm.weight"] * r_final[pos]
        for layer in range(L - 1, -1, -1):
            # g is at layer `layer`'s output: read the direct effect on what its MLP wrote (features, errors)
            s, e = starts[layer], starts[layer + 1]
            pos_s = active[s:e, 1]
            per_pos = g @ dec_vecs[layer].T                                        # (B, T, n_l) every position
            adjacency[out, s:e] = per_pos[:, pos_s, np.arange(e - s)]                # each at its own position
            adjacency[out, err0 + layer * T:err0 + (layer + 1) * T] = np.einsum("btd,td->bt", g, errors[layer])
            # the MLP passes nothing back (its features are nodes, its error a constant); a skip transcoder's
            # linear skip does
            if transcoders[layer].W_skip is not None:
                w, r = W[f"model.layers.{layer}.post_attention_layernorm.weight"], r_post[layer]
                g = g + (g @ transcoders[layer].W_skip) * w * r[:, None]
            # this layer's feature targets read its MLP input: their encoder rows through the frozen norm
            w, r = W[f"model.layers.{layer}.post_attention_layernorm.weight"], r_post[layer]
            for j, (kind, t_layer, pos, v) in enumerate(batch):
                if kind == "feature" and t_layer == layer:
                    g[j, pos] += v * w * r[pos]
            # back through the frozen attention to the layer's input
            p = f"model.layers.{layer}"
            g = g + attention_backward_frozen(g, cache[f"{p}.self_attn.attn_probs"].astype(np.float32),
                                              W[f"{p}.self_attn.v_proj.weight"], W[f"{p}.self_attn.o_proj.weight"],
                                              W[f"{p}.input_layernorm.weight"], r_in[layer], cfg.num_key_value_heads)
        adjacency[out, tok0:tok0 + T] = np.einsum("btd,td->bt", g, embeds)         # the tokens' embeddings
    decode_one = str if llm.tokenizer is None else (lambda t: llm.tokenizer.decode([int(t)]))
    return Graph(prompt if isinstance(prompt, str) else "".join(decode_one(t) for t in ids), list(ids), active,
                 np.concatenate(values), adjacency, logit_ids, logit_probs, L, list(transcoders), decode_one)


# ---- pruning (circuit-tracer's graph.prune_graph) -----------------------------------------------------

def normalize_matrix(matrix):
    m = np.abs(matrix)
    return m / np.maximum(m.sum(1, keepdims=True), 1e-10)


def compute_influence(A, logit_weights, max_iter: int = 1000):
    """logit_weights @ (A + A^2 + ...): A is a DAG's, so the powers reach zero."""
    current = logit_weights @ A
    influence = current.copy()
    for _ in range(max_iter):
        if not current.any():
            return influence
        current = current @ A
        influence += current
    raise NpqwenError(f"influence did not converge in {max_iter} steps (the graph has a cycle)")


def find_threshold(scores, threshold: float):
    ordered = np.sort(scores)[::-1]
    cumulative = np.cumsum(ordered) / ordered.sum()
    return ordered[min(int(np.searchsorted(cumulative, threshold)), len(cumulative) - 1)]


def prune_graph(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98):
    """(node_mask, edge_mask, cumulative_scores): keep the nodes, then the edges, that carry the given share of
    the influence on the logits (weighted by their probabilities); tokens and logits always stay."""
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= v <= 1.0:
            raise NpqwenError(f"{name} must be between 0 and 1, got {v}")
    A = graph.adjacency.astype(np.float64)
    n_tokens, n_logits, n_features = graph.n_pos, len(graph.logit_tokens), len(graph.active_features)
    logit_weights = np.zeros(len(A))
    logit_weights[-n_logits:] = graph.logit_probabilities
    node_influence = compute_influence(normalize_matrix(A), logit_weights)
    node_mask = node_influence >= find_threshold(node_influence, node_threshold)
    node_mask[-n_logits - n_tokens:] = True
    pruned = A.copy()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized = normalize_matrix(pruned)
    edge_scores = normalized * (compute_influence(normalized, logit_weights) + logit_weights)[:, None]
    edge_mask = edge_scores >= find_threshold(edge_scores.ravel(), edge_threshold)
    inner = slice(0, len(A) - n_logits - n_tokens)   # features and errors: they need an edge out (and features in)
    while True:
        old = node_mask.copy()
        node_mask[inner] &= edge_mask[:, inner].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        if (node_mask == old).all():
            break
    order = np.argsort(-node_influence, kind="stable")
    cumulative = np.zeros_like(node_influence)
    cumulative[order] = np.cumsum(node_influence[order]) / node_influence.sum()
    return node_mask, edge_mask, cumulative


# ---- circuit-tracer's JSON (utils/create_graph_files.py, frontend/graph_models.py) ----------------------

def process_token(token: str) -> str:
    return token.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def graph_json(graph: Graph, slug: str, scan: str, node_threshold: float = 0.8,
               edge_threshold: float = 0.98, labels: dict | None = None) -> dict:
    """The pruned graph as circuit-tracer's viewer reads it: {metadata, qParams, nodes, links}. `labels`
    (features.load_labels, one dict per layer or None) become the feature nodes' clerp."""
    node_mask, edge_mask, scores = prune_graph(graph, node_threshold, edge_threshold)
    n, L, T = len(graph.active_features), graph.n_layers, graph.n_pos
    err0, tok0, logit0 = n, n + L * T, n + L * T + T
    nodes = {}
    for i in np.flatnonzero(node_mask):
        common = dict(token_prob=0.0, is_target_logit=False, run_idx=0, reverse_ctx_idx=0, clerp="",
                      influence=float(scores[i]), activation=None)
        if i < err0:
            layer, pos, f = (int(v) for v in graph.active_features[i])
            label = (labels[layer] or {}).get(f, "") if labels else ""
            nodes[i] = {**common, "node_id": f"{layer}_{f}_{pos}", "feature": f, "layer": str(layer), "ctx_idx": pos,
                        "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{f}-0", "clerp": label,
                        "activation": float(graph.activation_values[i])}
        elif i < tok0:
            layer, pos = divmod(int(i - err0), T)
            nodes[i] = {**common, "node_id": f"0_{layer}_{pos}", "feature": -1, "layer": str(layer), "ctx_idx": pos,
                        "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_{pos}-0"}
        elif i < logit0:
            pos = int(i - tok0)
            vocab = graph.input_tokens[pos]
            nodes[i] = {**common, "node_id": f"E_{vocab}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos,
                        "feature_type": "embedding", "jsNodeId": f"E_{vocab}-{pos}"}
        else:
            j = int(i - logit0)
            vocab, p = int(graph.logit_tokens[j]), float(graph.logit_probabilities[j])
            token = process_token(graph.decode(vocab))
            nodes[i] = {**common, "node_id": f"{L + 1}_{vocab}_{T - 1}", "feature": vocab, "layer": str(L + 1),
                        "ctx_idx": T - 1, "feature_type": "logit", "token_prob": p, "is_target_logit": j == 0,
                        "jsNodeId": f"L_{vocab}-{T - 1}", "clerp": f'Output "{token}" (p={p:.3f})',
                        "influence": float(scores[i])}
    dsts, srcs = np.nonzero(edge_mask)
    links = [{"source": nodes[s]["node_id"], "target": nodes[d]["node_id"], "weight": float(graph.adjacency[d, s])}
             for d, s in zip(dsts, srcs) if s in nodes and d in nodes]
    linked = {x for link in links for x in (link["source"], link["target"])}
    used = [v for v in nodes.values() if v["node_id"] in linked or v["feature_type"] in ("embedding", "logit")]
    metadata = {"slug": slug, "scan": scan, "transcoder_list": [tc.source for tc in graph.transcoders],
                "prompt_tokens": [process_token(graph.decode(t)) for t in graph.input_tokens],
                "prompt": graph.prompt, "node_threshold": node_threshold}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": used, "links": links}


def save_graph_files(graph: Graph, llm, folder, slug: str, scan: str | None = None, node_threshold: float = 0.8,
                     edge_threshold: float = 0.98, labels=None) -> Path:
    """folder/{slug}.json and folder/graph-metadata.json (the list circuit-tracer's local viewer serves),
    as circuit-tracer's create_graph_files writes them; the graph file's path."""
    if not slug or not all(c.isalnum() or c in "-_." for c in slug):
        raise NpqwenError(f"slug {slug!r}: use letters, digits, '-', '_' and '.' (it names the file)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = graph_json(graph, slug, scan or (Path(str(llm.path)).name if llm.path else "npqwen"), node_threshold, edge_threshold, labels)
    path = folder / f"{slug}.json"
    path.write_text(json.dumps(data, indent=2, allow_nan=False))
    index = folder / "graph-metadata.json"
    listed = json.loads(index.read_text()) if index.exists() else {"graphs": []}
    listed["graphs"] = [g for g in listed["graphs"] if g["slug"] != slug] + [data["metadata"]]
    index.write_text(json.dumps(listed, indent=2))
    return path

