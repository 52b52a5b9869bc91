"""Qwen3.5's MTP head (npqwen/mtp.py) against the published formula built from transformers' own modules.

transformers 5.24 does not implement the head (Qwen3_5ForCausalLM ignores `mtp.*` on load), so the
reference is the formula vLLM's qwen3_next_mtp.py runs, with HF's pieces: Qwen3_5RMSNorm for the two
pre-fc norms, a bias-free Linear for fc, and for the decoder layer and mtp.norm a one-layer
Qwen3_5ForCausalLM (full attention) holding the head's weights and the main model's embedding and
lm_head, entered with inputs_embeds. The hidden state fed in is the main model's last_hidden_state
(after its final norm), as vLLM passes it."""
import json

import numpy as np
import pytest

import npqwen
from npqwen import Engine
from npqwen.checkpoint import index_checkpoint, read_tensor, save_safetensors
from npqwen.kv_cache import Batch
from npqwen.mtp import load_mtp

from hybrid_checkpoints import build_hybrid_checkpoint, hf_hybrid_classes, hf_hybrid_model, hybrid_config

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    """A random Qwen3.5 checkpoint written by transformers, with a random MTP head added to its file."""
    path = build_hybrid_checkpoint(tmp_path_factory.mktemp("mtp"), hybrid_config(), std=0.1)
    found = index_checkpoint(path)
    tensors = {}
    for name, info in found.items():
        tensors[name] = np.empty(info.shape, np.float32)
        read_tensor(info, tensors[name])
    rng = np.random.default_rng(3)
    for name, value in tensors.copy().items():   # layer 3 is full attention: the head's layer has its shapes
        if name.startswith("model.layers.3."):
            noise = rng.standard_normal(value.shape).astype(np.float32)
            tensors[name.replace("model.layers.3.", "mtp.layers.0.")] = (0.1 * noise if not name.endswith("norm.weight")
                                                                         else 0.2 * noise)
    D = tensors["model.norm.weight"].shape[0]
    tensors["mtp.fc.weight"] = 0.1 * rng.standard_normal((D, 2 * D)).astype(np.float32)
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        tensors[name] = 0.2 * rng.standard_normal(D).astype(np.float32)
    save_safetensors(path / "model.safetensors", tensors, "F32")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return path


def hf_mtp_logits(path, ids):
    """The formula with transformers' modules: (T-1, V) guesses at ids[t+2] from positions t = 0 .. T-2."""
    main = hf_hybrid_model(path)
    config_class, model_class = hf_hybrid_classes("qwen3_5_text")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    cfg = main.config.to_dict()
    cfg.update(num_hidden_layers=1, layer_types=["full_attention"])
    block = model_class(config_class(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}))
    found = index_checkpoint(path)

    def tensor(name):
        out = np.empty(found[name].shape, np.float32)
        read_tensor(found[name], out)
        return torch.from_numpy(out)

    state = {name: tensor(name.replace("model.layers.0.", "mtp.layers.0.").replace("model.norm.", "mtp.norm."))
             for name in block.state_dict() if name.startswith(("model.layers.0.", "model.norm."))}
    state["model.embed_tokens.weight"] = main.model.embed_tokens.weight.detach()
    state["lm_head.weight"] = main.lm_head.weight.detach()
    block.load_state_dict(state)
    D = cfg["hidden_size"]
    norm_e, norm_h = Qwen3_5RMSNorm(D, eps=cfg["rms_norm_eps"]), Qwen3_5RMSNorm(D, eps=cfg["rms_norm_eps"])
    norm_e.weight.data, norm_h.weight.data = tensor("mtp.pre_fc_norm_embedding.weight"), tensor("mtp.pre_fc_norm_hidden.weight")
    fc = torch.nn.Linear(2 * D, D, bias=False)
    fc.weight.data = tensor("mtp.fc.weight")
    with torch.no_grad():
        x = torch.tensor([ids])
        hidden = main.model(input_ids=x).last_hidden_state                     # (1, T, D) after the final norm
        y = fc(torch.cat([norm_e(main.model.embed_tokens(x[:, 1:])), norm_h(hidden[:, :-1])], dim=-1))
        return block.float().eval()(inputs_embeds=y).logits[0].numpy()          # (T-1, V)


def npqwen_hidden(llm, ids):
    """The main model's final-norm hidden states (T, D) for a sequence."""
    cache = llm.model.new_cache(len(ids))
    batch = Batch(np.array(ids), [0], [len(ids)], [cache.page_table], cache.kv.page_size, sample_rows=np.array([], int),
                  hidden_rows=np.arange(len(ids)))
    return np.asarray(llm.model.forward_batch(batch, cache.kv).hidden)


def test_mtp_head_equals_the_formula_in_hf_modules(mtp_dir):
    ids = np.random.default_rng(0).integers(0, 512, 24).tolist()
    llm = npqwen.load(mtp_dir)
    head = load_mtp(mtp_dir, llm.model)
    hidden = npqwen_hidden(llm, ids)
    cache = head.new_cache(64)
    _, first = head.forward(hidden[:10], ids[1:11], cache)         # in two pieces: the head's own KV cache carries
    _, rest = head.forward(hidden[10:-1], ids[11:], cache)
    ours = np.concatenate([np.asarray(first), np.asarray(rest)])
    reference = hf_mtp_logits(mtp_dir, ids)
    diff = np.abs(ours - reference).max()
    print(f"MTP logits: max |diff| {diff:.2e} over {ours.shape}; first argmax mismatch:",
          next((t for t in range(len(ours)) if ours[t].argmax() != reference[t].argmax()), None))
    assert diff < 1e-4


def test_mtp_drafts_in_the_engine_are_exact(mtp_dir):
    llm = npqwen.load(mtp_dir)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 512, n).tolist() for n in (12, 40, 7)]
    outs, proposed = {}, []
    for spec in (None, {"method": "mtp", "k": 3}):
        engine = Engine(llm, kv_cache_tokens=1024, page_size=16, max_batched_tokens=32)
        mtp_drafts = engine.mtp_drafts
        engine.mtp_drafts = lambda req, k: proposed.append((list(req.tokens), mtp_drafts(req, k))) or proposed[-1][1]
        ids = [engine.add_request(p, max_new_tokens=20, temperature=0, speculative=spec if i != 1 else None)
               for i, p in enumerate(prompts)]
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] += o.token_ids
            engine.check()
        outs[spec is None] = [got[i] for i in ids]
        print(spec, {k: v for k, v in engine.stats.items() if k.startswith("spec")})
    assert outs[False] == outs[True]
    assert engine.stats["spec_decode_num_draft_tokens"] > 0
    # the head fed a step at a time, its chained positions dropped, drafts what it drafts run afresh on the sequence
    head = load_mtp(mtp_dir, llm.model)
    for tokens, drafts in proposed[::7]:
        cache = head.new_cache(len(tokens) + 8)
        states, logits = head.forward(npqwen_hidden(llm, tokens[:-1]), tokens[1:], cache)
        assert head.chain(np.asarray(states[-1]), int(np.argmax(logits[-1])), cache, len(drafts)) == drafts
