"""Steering through the engine: a steered request beside an unsteered one in the same batches, the
unsteered one as if alone, the steered one equal to HF generate with the same forward hook; the
prefix cache keyed by the steering; npqwen.steering_vector; the checks."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine

from conftest import build_hf_checkpoint, hf_model, tiny_config
from serving import tokens_to_end
from tolerance import EPS32

PROMPT_A = [5, 17, 33, 2, 101, 7, 64, 250, 9, 12, 40, 41, 3]
PROMPT_B = [8, 19, 300, 77, 6]
N = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_hf_checkpoint(tmp_path_factory.mktemp("steer"), tiny_config(), save_dtype="float32", std=0.4)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return npqwen.load(checkpoint)


def steer(llm, layer=1, scale=3.0, seed=0):
    v = np.random.default_rng(seed).standard_normal(llm.config.hidden_size).astype(np.float32)
    return [{"layer": layer, "vector": v, "scale": scale}]


def run(engine, requests) -> dict:
    """Step to the end; each request's tokens, by the order they were added."""
    return tokens_to_end(engine, [engine.add_request(p, max_new_tokens=N, temperature=0, steering=s)
                                  for p, s in requests])


def hf_steered(model, ids, steering):
    import torch

    s = steering[0]
    add = torch.from_numpy(s["scale"] * s["vector"])

    def hook(module, args, out):
        return (out[0] + add, *out[1:]) if isinstance(out, tuple) else out + add
    handle = model.model.layers[s["layer"]].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    finally:
        handle.remove()
    return out[0, len(ids):].tolist()


def test_steered_beside_unsteered(llm, checkpoint):
    s = steer(llm)
    steered, plain = run(Engine(llm, kv_cache_tokens=512, page_size=8), [(PROMPT_A, s), (PROMPT_B, None)])
    (alone,) = run(Engine(llm, kv_cache_tokens=512, page_size=8), [(PROMPT_B, None)])
    (unsteered_a,) = run(Engine(llm, kv_cache_tokens=512, page_size=8), [(PROMPT_A, None)])
    want = hf_steered(hf_model(checkpoint), PROMPT_A, s)
    print(f"steered  {steered}\nHF hook  {want}\nunsteered A {unsteered_a}\nbeside   {plain}\nalone    {alone}")
    assert plain == alone
    assert steered == want[:len(steered)] and len(steered) == N
    assert steered != unsteered_a


def test_llm_generate_takes_steering(llm):
    s = steer(llm)
    got = llm.generate(PROMPT_A, max_new_tokens=N, temperature=0, steering=s).token_ids
    (want,) = run(Engine(llm, kv_cache_tokens=512, page_size=8), [(PROMPT_A, s)])
    assert got == want
    many = llm.generate([PROMPT_A, PROMPT_B], max_new_tokens=N, temperature=0, steering=s)
    assert many[0].token_ids == want


def test_the_prefix_cache_is_keyed_by_the_steering(llm):
    s = steer(llm)
    engine = Engine(llm, kv_cache_tokens=512, page_size=4)
    (plain,) = run(engine, [(PROMPT_A, None)])
    (steered,) = run(engine, [(PROMPT_A, s)])             # the unsteered pages are not reused
    (fresh,) = run(Engine(llm, kv_cache_tokens=512, page_size=4), [(PROMPT_A, s)])
    assert steered == fresh != plain
    hits = engine.cache.hit_tokens
    (again,) = run(engine, [(PROMPT_A, s)])               # the same steering reuses its own pages
    assert again == fresh and engine.cache.hit_tokens > hits


def test_steering_vector_is_the_mean_difference_at_the_last_position():
    llm = npqwen.load("tiny")
    pos, neg = ["I love it", "great fun"], ["I hate it"]
    v = npqwen.steering_vector(llm, pos, neg, layer=1)

    def last(p):
        return llm.run_with_cache(p, names=["model.layers.1"])[1]["model.layers.1"][-1].astype(np.float64)
    want = (last(pos[0]) + last(pos[1])) / 2 - last(neg[0])
    assert v.shape == (llm.config.hidden_size,) and v.dtype == np.float32
    # float32 hidden states (their runs are the same sums), averaged in float64 here: one rounding to float32 apart
    assert np.allclose(v, want, rtol=0, atol=2 * EPS32 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("steering, says", [
    ([{"layer": 0, "vector": [1.0, 2.0]}], r"steering\[0\].vector must have 16 values"),
    ([{"layer": 5, "vector": np.zeros(16)}], r"steering\[0\].layer must be a layer from 0 to 1, got 5"),
    ([{"layer": 0, "vector": np.full(16, np.nan)}], r"steering\[0\].vector must hold finite numbers"),
    ([{"layer": 0, "vector": np.zeros(16), "scale": float("inf")}], r"steering\[0\].scale must be a finite number"),
    ([{"layer": 0, "vector": np.zeros(16), "sclae": 1}], r"steering\[0\] has unknown field 'sclae'"),
    ({"layer": 0}, "steering must be a list"),
])
def test_bad_steering_is_named(steering, says):
    llm = npqwen.load("tiny")
    with pytest.raises(npqwen.NpqwenError, match=says):
        llm.generate("hi", max_new_tokens=2, steering=steering)
