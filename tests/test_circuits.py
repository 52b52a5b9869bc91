"""Attribution graphs (npqwen/circuits.py): every direct effect against torch autograd on HF transformers with the
same transcoders, in the local replacement model made by hand (attention patterns and RMSNorm scales detached, each
MLP's output replaced by a leaf: its transcoder's features are nodes, its error a constant); the pruned graph's JSON
against the schema circuit-tracer's viewer and Neuronpedia's graph upload read. A 3-layer model of width 64."""
import json

import numpy as np
import pytest

import npqwen
from npqwen import NpqwenError, circuits
from npqwen.features import SAE

from conftest import hf_model, tiny_config, write_npqwen_checkpoint

torch = pytest.importorskip("torch")

PROMPT = [5, 17, 33, 2, 101, 7]
F = 24
TOL = 2e-5   # max |npqwen - torch| / max |torch| over the adjacency matrix (float32 both)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("circuits"), tiny_config())   # float32, HF's names


@pytest.fixture(scope="module")
def llm(checkpoint):
    return npqwen.load(checkpoint)


@pytest.fixture(scope="module")
def transcoders(llm):
    """Random JumpReLU transcoders, one per layer, from each layer's MLP input to its output."""
    rng, D = np.random.default_rng(0), llm.config.hidden_size
    return [SAE((rng.standard_normal((D, F)) / D ** 0.5).astype(np.float32), (0.1 * rng.standard_normal(F)).astype(
        np.float32), (rng.standard_normal((F, D)) / F ** 0.5).astype(np.float32), np.zeros(D, np.float32), "jumprelu",
        f"model.layers.{i}.post_attention_layernorm", f"model.layers.{i}.mlp.down_proj",
        threshold=np.full(F, 0.5, np.float32), source=f"layer_{i}.safetensors") for i in range(3)]


@pytest.fixture(scope="module")
def graph(llm, transcoders):
    return circuits.attribution_graph(llm, PROMPT, transcoders)


def frozen_hf(checkpoint, monkeypatch):
    """HF's model with the replacement model's freezes: softmax patterns and RMSNorm's 1/rms detached."""
    from transformers.models.qwen3 import modeling_qwen3 as m

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k, v = m.repeat_kv(key, module.num_key_value_groups), m.repeat_kv(value, module.num_key_value_groups)
        weights = torch.matmul(query, k.transpose(2, 3)) * scaling + attention_mask
        weights = torch.softmax(weights, dim=-1, dtype=torch.float32).detach()   # the frozen pattern
        return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights

    def rms_norm(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).detach()

    monkeypatch.setattr(m, "eager_attention_forward", eager)
    monkeypatch.setattr(m.Qwen3RMSNorm, "forward", rms_norm)
    model = hf_model(checkpoint)
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture
def one_thread():   # ~150 tiny backward passes: torch's thread pool only spins on a shared machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def torch_adjacency(model, graph, transcoders, logits_only=False):
    """The adjacency matrix by torch autograd on HF (frozen_hf): one backward per target; rows of the feature
    targets left at zero with logits_only."""
    seen = {"mlp_in": [], "mlp_out": []}

    def mlp_hook(module, args, out):   # the MLP's output becomes a leaf: its features are nodes, its error a constant
        layer = len(seen["mlp_out"])
        seen["mlp_in"].append(args[0])
        leaf = out.detach().requires_grad_(True)
        seen["mlp_out"].append(leaf)
        W_skip = transcoders[layer].W_skip
        if W_skip is None:
            return leaf
        skip = args[0] @ torch.tensor(W_skip).T                   # a skip transcoder's linear part carries gradient
        return leaf + skip - skip.detach()

    def embed_hook(module, args, out):
        seen["embed"] = out.detach().requires_grad_(True)
        return seen["embed"]
    handles = [layer.mlp.register_forward_hook(mlp_hook) for layer in model.model.layers]
    handles.append(model.model.embed_tokens.register_forward_hook(embed_hook))
    logits = model(torch.tensor([PROMPT])).logits[0]
    for h in handles:
        h.remove()
    T, L, n = len(PROMPT), 3, len(graph.active_features)
    # the sources, from HF's own activations: each active feature's a * W_dec[f], each error, each embedding
    sources = []
    for layer, tc in enumerate(transcoders):
        x = seen["mlp_in"][layer][0].detach()
        pre = x @ torch.tensor(tc.W_enc) + torch.tensor(tc.b_enc)
        acts = pre * (pre > torch.tensor(tc.threshold))
        recon = acts @ torch.tensor(tc.W_dec) + torch.tensor(tc.b_dec)
        if tc.W_skip is not None:
            recon = recon + x @ torch.tensor(tc.W_skip).T
        sources.append((acts, seen["mlp_out"][layer][0].detach() - recon))
    active = [[layer, p, f] for layer in range(L) for p, f in torch.nonzero(sources[layer][0]).tolist()]
    assert active == graph.active_features.tolist()
    targets = [] if logits_only else [seen["mlp_in"][layer][0, p] @ torch.tensor(transcoders[layer].W_enc[:, f])
                                      for layer, p, f in active]
    targets += [logits[-1, v] - logits[-1].mean() for v in graph.logit_tokens.tolist()]
    want = np.zeros_like(graph.adjacency)
    rows = ([] if logits_only else list(range(n))) + list(range(n + L * T + T, len(want)))
    writes = torch.stack([sources[layer][0][p, f] * torch.tensor(transcoders[layer].W_dec[f])
                          for layer, p, f in active])                                  # (n, D) a * W_dec[f]
    errors = torch.stack([e for _, e in sources])                                       # (L, T, D)
    where = torch.tensor(graph.active_features[:, :2])                                  # (n, 2) layer, position
    for row, target in zip(rows, targets):
        grads = torch.autograd.grad(target, seen["mlp_out"] + [seen["embed"]], retain_graph=True, allow_unused=True)
        g = torch.stack([torch.zeros(T, 64) if x is None else x[0] for x in grads])    # (L + 1, T, D)
        want[row, :n] = (g[where[:, 0], where[:, 1]] * writes).sum(-1)
        want[row, n:n + L * T] = (g[:L] * errors).sum(-1).reshape(-1)
        want[row, n + L * T:n + L * T + T] = (g[L] * seen["embed"][0].detach()).sum(-1)
    return want, torch.softmax(logits[-1].detach().double(), -1)[graph.logit_tokens].numpy()


def test_direct_effects_equal_torch_autograd(checkpoint, graph, transcoders, monkeypatch, one_thread):
    want, probs = torch_adjacency(frozen_hf(checkpoint, monkeypatch), graph, transcoders)
    err = np.abs(graph.adjacency - want).max() / np.abs(want).max()
    print(f"{len(graph.active_features)} features, {len(graph.logit_tokens)} logits; max |npqwen - torch| / "
          f"max |torch| = {err:.2e}; {(want != 0).sum()} nonzero effects")
    assert err <= TOL
    assert np.allclose(graph.logit_probabilities, probs, rtol=1e-5) and (np.diff(graph.logit_probabilities) <= 0).all()


def test_a_skip_transcoder_s_skip_carries_the_gradient(llm, checkpoint, transcoders, monkeypatch, one_thread):
    """circuit-tracer's skip transcoders add x @ W_skip.T, linear in the MLP's input: the backward goes through it
    (the logits' rows, against torch)."""
    rng = np.random.default_rng(1)
    tcs = list(transcoders)
    tcs[1] = SAE(**{**tcs[1].__dict__, "W_skip": (0.3 * rng.standard_normal((64, 64))).astype(np.float32)})
    graph = circuits.attribution_graph(llm, PROMPT, tcs)
    want, _ = torch_adjacency(frozen_hf(checkpoint, monkeypatch), graph, tcs, logits_only=True)
    rows = slice(len(want) - len(graph.logit_tokens), None)
    err = np.abs(graph.adjacency[rows] - want[rows]).max() / np.abs(want[rows]).max()
    plain = circuits.attribution_graph(llm, PROMPT, transcoders).adjacency[rows]
    print(f"logit rows with a skip in layer 1: max |npqwen - torch| / max |torch| = {err:.2e}")
    tokens = slice(len(want) - len(graph.logit_tokens) - len(PROMPT), len(want) - len(graph.logit_tokens))
    assert err <= TOL and not np.allclose(graph.adjacency[rows, tokens], plain[:, tokens])   # the skip mattered


# what circuit-tracer's viewer (frontend/graph_models.py Model) and Neuronpedia's graph upload require
NODE_TYPES = ["cross layer transcoder", "mlp reconstruction error", "embedding", "logit"]
SCHEMA = {
    "type": "object", "required": ["metadata", "qParams", "nodes", "links"],
    "properties": {
        "metadata": {"type": "object", "required": ["slug", "scan", "transcoder_list", "prompt_tokens", "prompt"],
                     "properties": {"slug": {"type": "string"}, "scan": {"type": "string"},
                                    "transcoder_list": {"type": "array", "items": {"type": "string"}},
                                    "prompt_tokens": {"type": "array", "items": {"type": "string"}},
                                    "prompt": {"type": "string"}, "node_threshold": {"type": ["number", "null"]}}},
        "qParams": {"type": "object", "required": ["pinnedIds", "supernodes", "linkType", "clickedId", "sg_pos"],
                    "properties": {"pinnedIds": {"type": "array", "items": {"type": "string"}},
                                   "supernodes": {"type": "array", "items": {"type": "array"}},
                                   "linkType": {"type": "string"}, "clickedId": {"type": "string"},
                                   "sg_pos": {"type": "string"}}},
        "nodes": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "required": ["node_id", "feature", "layer", "ctx_idx", "feature_type", "jsNodeId", "clerp"],
            "properties": {"node_id": {"type": "string"}, "feature": {"type": "integer"}, "layer": {"type": "string"},
                           "ctx_idx": {"type": "integer"}, "feature_type": {"enum": NODE_TYPES},
                           "token_prob": {"type": "number"}, "is_target_logit": {"type": "boolean"},
                           "run_idx": {"type": "integer"}, "reverse_ctx_idx": {"type": "integer"},
                           "jsNodeId": {"type": "string"}, "clerp": {"type": "string"},
                           "influence": {"type": ["number", "null"]}, "activation": {"type": ["number", "null"]}}}},
        "links": {"type": "array", "items": {
            "type": "object", "required": ["source", "target", "weight"], "additionalProperties": False,
            "properties": {"source": {"type": "string"}, "target": {"type": "string"}, "weight": {"type": "number"}}}},
    },
}


def test_the_json_is_circuit_tracer_s(llm, graph, tmp_path):
    import jsonschema

    labels = [{int(graph.active_features[0, 2]): "a label"}, None, None]
    path = circuits.save_graph_files(graph, llm, tmp_path, "demo", scan="tiny-test", labels=labels)
    data = json.loads(path.read_text())
    jsonschema.validate(data, SCHEMA)
    ids = [node["node_id"] for node in data["nodes"]]
    # unique within a type: circuit-tracer's error node 0_{layer}_{pos} can share a layer-0 feature's id
    # {layer}_{feature}_{pos} (its create_graph_files writes the same), so ids are unique per feature_type
    assert len({(node["feature_type"], node["node_id"]) for node in data["nodes"]}) == len(ids) and {x for link in data["links"] for x in (link["source"], link["target"])} <= \
        set(ids)
    kinds = {node["feature_type"] for node in data["nodes"]}
    assert {"embedding", "logit"} <= kinds and len(data["links"]) > 0
    assert sum(node["feature_type"] == "embedding" for node in data["nodes"]) == len(PROMPT)
    top = [node for node in data["nodes"] if node.get("is_target_logit")]
    assert len(top) == 1 and top[0]["node_id"] == f"4_{graph.logit_tokens[0]}_{len(PROMPT) - 1}"
    for node in data["nodes"]:   # feature nodes: layer_feature_position, as circuit-tracer's Node.feature_node
        if node["feature_type"] == "cross layer transcoder":
            layer, f, p = map(int, node["node_id"].split("_"))
            assert node["jsNodeId"] == f"{layer}_{f}-0" and node["ctx_idx"] == p and node["activation"] > 0
            assert node["clerp"] == (labels[layer] or {}).get(f, "")
    index = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert index == {"graphs": [data["metadata"]]}
    # pruning keeps every token and logit, and fewer features with a lower node threshold
    node_mask, edge_mask, _ = circuits.prune_graph(graph, 0.5, 0.9)
    assert node_mask[-len(PROMPT) - len(graph.logit_tokens):].all()
    assert node_mask.sum() <= circuits.prune_graph(graph, 0.8, 0.98)[0].sum()


def test_mistakes_are_named(llm, transcoders):
    with pytest.raises(NpqwenError, match=r"one transcoder per layer \(3\)"):
        circuits.attribution_graph(llm, PROMPT, transcoders[:2])
    with pytest.raises(NpqwenError, match="node_threshold must be between 0 and 1"):
        circuits.prune_graph(circuits.attribution_graph(llm, PROMPT[:2], transcoders), 1.5)
