"""Qwen4-Exp's residual is C streams of D (T, C*D), as hooks see model.layers.L. Steering a layer adds a (D,) vector
to every stream (a (C*D,) one stream by stream) and an SAE feature edit reads and moves all C*D values: each equal to
HF's Qwen4-Exp with a torch forward hook on model.layers[L] doing the same (logits and greedy tokens), and through the
engine beside an unsteered request (= alone). Speculative decoding ("ngram"): its verification keeps the PLE
convolutions' states and n-gram history after each token and rolls them back with the Gated DeltaNet states, so greedy
output with drafts (prompt lookup, mostly right, all wrong) is token for token the output without. The MTP head stays
refused, with its reason."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine
from npqwen.errors import NpqwenError
from npqwen.features import SAE, check_feature_edits
from npqwen.hooks import residual_width
from npqwen.kv_cache import Batch
from npqwen.steering import batch_steering, check_steering

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

from serving import tokens_to_end   # noqa: E402
from test_qwen4_exp import MODEL, build   # noqa: E402  (after the skips: it imports transformers' module)

PROMPT = np.random.default_rng(11).integers(0, MODEL["vocab_size"], 14).tolist()
OTHER = np.random.default_rng(12).integers(0, MODEL["vocab_size"], 6).tolist()
N, LAYER = 10, 1
C, D = MODEL["hc_count"], MODEL["hidden_size"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, ref = build(tmp_path_factory.mktemp("qwen4_steer"))
    return path, npqwen.load(path), ref


def hooked(ref, fn, ids, generate: bool):
    """HF's logits (T, V) of `ids`, or its greedy continuation, with fn(x (1, T, C*D)) -> x on model.layers[LAYER]."""
    handle = ref.model.layers[LAYER].register_forward_hook(lambda m, a, out: fn(out))
    try:
        with torch.no_grad():
            if generate:
                out = ref.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, min_new_tokens=N,
                                   eos_token_id=None, pad_token_id=0)
                return out[0, len(ids):].tolist()
            return ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    finally:
        handle.remove()


def engine_tokens(llm, requests, **engine_args) -> list:
    """Every request (prompt, add_request keywords) stepped together to the end; each one's tokens, checked."""
    engine = Engine(llm, kv_cache_tokens=512, page_size=8, **engine_args)
    return tokens_to_end(engine, [engine.add_request(p, max_new_tokens=N, temperature=0, **kw) for p, kw in requests])


def until_eos(tokens: list) -> list:
    """HF's tokens (generated past eos) up to the first eos, where the engine stops."""
    eos = MODEL["eos_token_id"]
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def prompt_logits(llm, **edits):
    """forward_batch's logits of every PROMPT row with Batch.steering / Batch.feature_edits set."""
    T, cache = len(PROMPT), llm.model.new_cache(len(PROMPT))
    batch = Batch(np.array(PROMPT), [0], [T], [cache.page_table], cache.kv.page_size, sample_rows=np.arange(T),
                  **edits)
    return llm.model.forward_batch(batch, cache.kv).logits


@pytest.mark.parametrize("width", ["D", "C*D"])
def test_steering_equals_hf_with_a_hook(model, width):
    path, llm, ref = model
    rng = np.random.default_rng(0)
    v = rng.standard_normal(D if width == "D" else C * D).astype(np.float32)
    s = [{"layer": LAYER, "vector": v, "scale": 2.0}]
    add = torch.from_numpy(np.tile(2.0 * v, C * D // len(v)))   # a (D,) vector goes to each of the C streams
    want = hooked(ref, lambda x: x + add, PROMPT, generate=False)
    adds = batch_steering([(check_steering(s, llm.config), 0, len(PROMPT))], len(PROMPT), residual_width(llm.config),
                          llm.model.xp, llm.model.dtype)   # {LAYER: (T, C*D)}, as the engine makes it
    got = prompt_logits(llm, steering=adds)
    moved = np.abs(got - llm.forward(PROMPT)).max()
    print(f"steering ({width}): max |npqwen - HF with a hook| {np.abs(got - want).max():.2e}, moved {moved:.2f}")
    assert np.abs(got - want).max() < 1e-4 and moved > 1e-1
    if width != "D":   # steering_vector reads model.layers.L: C*D values; the engine: the (D,) case is enough
        made = npqwen.steering_vector(llm, [PROMPT], [OTHER], LAYER)
        assert made.shape == (C * D,) and check_steering([{"layer": LAYER, "vector": made}], llm.config)
        return
    steered, plain = engine_tokens(llm, [(PROMPT, dict(steering=s)), (OTHER, {})])
    (alone,) = engine_tokens(llm, [(OTHER, {})])
    hf = hooked(ref, lambda x: x + add, PROMPT, generate=True)
    unsteered = llm.generate(PROMPT, max_new_tokens=N, temperature=0).token_ids
    print(f"steered {steered}\nHF hook {hf}\nunsteered {unsteered}\nbeside {plain}\nalone  {alone}")
    assert until_eos(hf) == steered and plain == alone and steered != unsteered


def test_feature_edit_equals_hf_with_a_hook(model):
    """A TopK SAE on model.layers.1, all C*D values: clamping its strongest feature, against HF's hook."""
    path, llm, ref = model
    F, k, rng = 64, 8, np.random.default_rng(1)
    w = {"W_enc": rng.standard_normal((C * D, F)) / (C * D) ** 0.5, "b_enc": 0.1 * rng.standard_normal(F),
         "W_dec": rng.standard_normal((F, C * D)) / F ** 0.5, "b_dec": 0.1 * rng.standard_normal(C * D)}
    w = {n: a.astype(np.float32) for n, a in w.items()}
    sae = SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], "topk", f"model.layers.{LAYER}",
              f"model.layers.{LAYER}", k=k, source="test")
    _, (run,) = llm.run_with_saes(PROMPT, sae, top=1)
    feature, value = int(run.indices[-1, 0]), 30.0
    t = {n: torch.from_numpy(a) for n, a in w.items()}

    def edit(x):   # x + (a' - a) W_dec[f], a = the TopK activation of the feature
        pre = x @ t["W_enc"] + t["b_enc"]
        vals, idx = pre.topk(k, dim=-1)
        a = torch.zeros_like(pre).scatter(-1, idx, torch.relu(vals))[..., feature]
        return x + (value - a)[..., None] * t["W_dec"][feature]

    edits = [{"sae": sae, "feature": feature, "clamp": value}]
    (e,) = check_feature_edits(edits, llm.config)
    got = prompt_logits(llm, feature_edits={LAYER: [(e, 0, len(PROMPT))]})
    want = hooked(ref, edit, PROMPT, generate=False)
    moved = np.abs(got - llm.forward(PROMPT)).max()
    print(f"feature edit: max |npqwen - HF with a hook| {np.abs(got - want).max():.2e}, moved {moved:.2f}")
    assert np.abs(got - want).max() < 1e-4 and moved > 1e-1
    edited, plain = engine_tokens(llm, [(PROMPT, dict(feature_edits=edits)), (OTHER, {})])
    (alone,) = engine_tokens(llm, [(OTHER, {})])
    hf = hooked(ref, edit, PROMPT, generate=True)
    print(f"edited {edited}\nHF hook {hf}\nbeside {plain}\nalone  {alone}")
    assert until_eos(hf) == edited and plain == alone
    narrow = SAE(w["W_enc"][:D], w["b_enc"], w["W_dec"][:, :D], w["b_dec"][:D], "topk", "model.layers.1",
                 "model.layers.1", k=k, source="narrow")
    with pytest.raises(NpqwenError, match=f"model.layers.1 of this Qwen4-Exp model is its {C} residual streams"):
        check_feature_edits([{"sae": narrow, "feature": 0, "zero": True}], llm.config)


def test_bad_steering_names_both_widths(model):
    with pytest.raises(NpqwenError, match=rf"must have {D} values \(the model's hidden size, added to each of its "
                                          rf"{C} residual streams, or {C * D}: one per stream\), got shape \(5,\)"):
        model[1].generate(PROMPT, max_new_tokens=2, steering=[{"layer": 0, "vector": np.ones(5)}])


def answers_known(prompts, answers, wrong: bool, corrupt: float = 0.0, seed: int = 0):
    """A proposer from the answers decoding without drafts gave: what follows (each replaced by a random token with
    probability `corrupt`), or with `wrong` every draft one token off (all refused)."""
    rng, known, V = np.random.default_rng(seed), {tuple(p): a for p, a in zip(prompts, answers)}, MODEL["vocab_size"]

    def propose(req):
        if req.params.speculative is None or req.uncomputed != 1:
            return []
        have = len(req.output_ids)
        truth = known[tuple(req.prompt_ids)][have:have + min(req.params.speculative.k, req.max_new_tokens - have - 1)]
        return [(t + 1) % V if wrong else int(rng.integers(V)) if rng.random() < corrupt else t for t in truth]
    return propose


def test_speculative_greedy_equals_decoding_without_drafts(model):
    _, llm, _ = model
    rng = np.random.default_rng(5)
    prompts = [list(range(40, 52)) * 3, rng.integers(0, 300, 41).tolist(), [9, 8, 7, 6, 5] * 4]

    def run(spec, propose=None, **engine_args):
        engine = Engine(llm, **{"kv_cache_tokens": 512, "page_size": 16, "max_batched_tokens": 48, **engine_args})
        if propose is not None:
            engine.propose = propose
        ids = [engine.add_request(p, max_new_tokens=24, temperature=0, speculative=spec if i != 1 else None)
               for i, p in enumerate(prompts)]   # the second beside them, never speculating
        out = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.token_ids
            engine.check()
        return [out[i] for i in ids], engine.stats

    plain, _ = run(None)
    for what, spec, propose, args in [
            ("prompt lookup", {"method": "ngram", "k": 4}, None, {}),
            ("mostly right", {"method": "ngram", "k": 3}, answers_known(prompts, plain, False, 0.2), {}),
            ("all wrong", {"method": "ngram", "k": 3}, answers_known(prompts, plain, True), {}),
            ("mostly right, preempted", {"method": "ngram", "k": 5}, answers_known(prompts, plain, False, 0.1),
             {"kv_cache_tokens": 7 * 16})]:
        drafted, stats = run(spec, propose, **args)
        kept, drafts = stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]
        print(f"{what}: {kept} of {drafts} drafts kept, preemptions {stats['preemptions']}")
        assert drafted == plain, (what, plain, drafted)
        assert drafts > 0 and (kept == 0 if what == "all wrong" else 0 < kept < drafts)
        if "preempted" in what:
            assert stats["preemptions"] > 0


def test_mtp_is_refused_with_its_reason(model):
    with pytest.raises(NpqwenError, match=r'speculative method "mtp" is not implemented for it: its MTP head \(mtp\.\* '
                                          r"weights\) is ignored by transformers"):
        model[1].generate(PROMPT, max_new_tokens=2, temperature=0, speculative={"method": "mtp", "k": 2})
