"""Qwen3.5 and Qwen4-Exp on device="cuda" without a GPU: the CuPy code path on the strict stand-in
(tests/strict_cupy.py) gives HF's logits as on the CPU, and the engine's tokens equal the CPU's; every cupy name it
uses exists."""
import numpy as np
import pytest

import npqwen
import strict_cupy
from npqwen import Engine

from hybrid_checkpoints import build_hybrid_checkpoint, hf_hybrid_model, hybrid_config, qwen3_next_config
from tolerance import model_tolerance, relative_diff

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def cupy():
    with pytest.MonkeyPatch.context() as mp:
        yield strict_cupy.install(mp)


@pytest.mark.parametrize("build", [hybrid_config, qwen3_next_config])
def test_logits_match_hf_on_the_stand_in(build, tmp_path):
    path = build_hybrid_checkpoint(tmp_path, build())
    assert_logits_match_hf(npqwen.load(path, device="cuda"), hf_hybrid_model(path),
                           np.random.default_rng(0).integers(0, 512, 70).tolist(), build.__name__)


def assert_logits_match_hf(llm, ref, ids, name: str):
    """llm's logits on the stand-in against the HF model ref's on ids, within the model's tolerance, argmax equal."""
    logits = npqwen.backend.to_numpy(llm.forward(ids))
    with torch.no_grad():
        want = ref(torch.tensor([ids]), use_cache=False).logits[0].numpy()
    rel, tolerance = relative_diff(logits, want), model_tolerance(llm.config, len(ids))
    print(f"{name} on the CuPy stand-in: relative max |logit diff| {rel:.2e} (tolerance {tolerance:.1e})")
    assert rel <= tolerance and (logits.argmax(-1) == want.argmax(-1)).all()


def test_engine_equals_cpu_on_the_stand_in(tmp_path):
    """Three prompts together, then one that shares the third's first 80 tokens (its last full page, where
    it left a snapshot): a prefix hit, the linear layers' states restored from the snapshot
    (engine/state_snapshots.py), on the stand-in as on the CPU."""
    path = build_hybrid_checkpoint(tmp_path, hybrid_config(), std=0.1)
    prompts = [np.random.default_rng(s).integers(0, 512, n).tolist() for s, n in enumerate([3, 40, 90])]
    rounds = [prompts, [prompts[2][:80] + [5, 6, 7]]]
    tokens = {}
    for device in ("cpu", "cuda"):
        engine = Engine(npqwen.load(path, device=device), kv_cache_tokens=512, page_size=16, max_batched_tokens=32)
        tokens[device] = []
        for batch in rounds:
            ids = [engine.add_request(p, max_new_tokens=6, temperature=0) for p in batch]
            out = {i: [] for i in ids}
            while engine.has_unfinished():
                for o in engine.step():
                    out[o.request_id] += o.token_ids
                engine.check()
            tokens[device] += [out[i] for i in ids]
        print(device, "prefix hit tokens:", engine.stats["prefix_cache_hit_tokens"])
        assert engine.stats["prefix_cache_hit_tokens"] == 80
    assert tokens["cuda"] == tokens["cpu"]


def test_qwen4_exp_on_the_stand_in(tmp_path):
    """Qwen4-Exp (hyper-connections, QSA's selection, PLE) on the stand-in: HF's logits; through the engine, a
    request with ngram drafts and a steered one beside it, the same tokens as on the CPU."""
    pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    from test_qwen4_exp import build

    path, ref = build(tmp_path / "qwen4")
    ids = np.random.default_rng(0).integers(0, 300, 40).tolist()
    assert_logits_match_hf(npqwen.load(path, device="cuda"), ref, ids, "Qwen4-Exp")
    steer = [{"layer": 1, "vector": np.ones(32, np.float32), "scale": 0.5}]
    tokens, drafts = {}, {}
    for device in ("cpu", "cuda"):
        engine = Engine(npqwen.load(path, device=device), kv_cache_tokens=512, page_size=16)
        requests = [engine.add_request(list(range(300)), max_new_tokens=8, temperature=0,   # every token seen: drafts
                                       speculative={"method": "ngram", "k": 3}),
                    engine.add_request(ids[:9], max_new_tokens=8, temperature=0, steering=steer)]
        out = {i: [] for i in requests}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.token_ids
            engine.check()
        tokens[device] = [out[i] for i in requests]
        drafts[device] = engine.stats["spec_decode_num_draft_tokens"], engine.stats["spec_decode_num_accepted_tokens"]
        print(device, tokens[device], "drafts, kept:", drafts[device])
    assert tokens["cuda"] == tokens["cpu"] and drafts["cuda"] == drafts["cpu"] and drafts["cpu"][0] > 0


def test_every_name_and_keyword_used_exists_in_real_cupy():
    """What the runs above asked of cupy (the delta rule's einsum, tril, cumsum, repeat, ...) is real cupy."""
    from test_cuda_standin import check_against, real_cupy

    problems = check_against(real_cupy(), dict(strict_cupy.used))
    assert not problems, "\n".join(problems)
