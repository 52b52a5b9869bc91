"""Qwen3.5 in the engine: batched equals alone token for token (chunked prompts, preemption, abort),
with the state slots' bookkeeping checked after every step; the prefix cache is off for hybrid models."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine

from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_config
from test_engine import alone, compare, prompts, run

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hybrid64(tmp_path_factory):
    path = build_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_engine"),
                                   hybrid_config(layer_types=["linear_attention", "full_attention",
                                                              "linear_attention", "linear_attention"]), std=0.1)
    return npqwen.load(path, dtype="float64")


def test_batched_equals_alone(hybrid64):
    ps = prompts([1, 2, 5, 17, 64, 65, 130, 300], seed=11)
    news = [3 + (5 * i) % 11 for i in range(len(ps))]
    engine = Engine(hybrid64, kv_cache_tokens=16 * 100, page_size=16, max_batched_tokens=96, max_batch_size=5)
    results = run(engine, [(p, dict(max_new_tokens=n, temperature=0)) for p, n in zip(ps, news)], spy=True)
    worst = max(compare(f"hybrid prompt {len(p)}", r[0], r[1], *alone(hybrid64, p, n))
                for p, n, r in zip(ps, news, results))
    assert worst <= 1e-10
    assert engine.stats["prefix_cache_hit_tokens"] == 0 and len(engine.states.free) == 5


@pytest.mark.parametrize("budget", [7, 64])
def test_chunked_prompt_equals_whole(hybrid64, budget):
    ps = prompts([300, 33, 150], seed=12)
    reqs = [(p, dict(max_new_tokens=5, temperature=0)) for p in ps]
    whole = run(Engine(hybrid64, kv_cache_tokens=2048, page_size=32, max_batched_tokens=1024), reqs, spy=True)
    chunked = run(Engine(hybrid64, kv_cache_tokens=2048, page_size=32, max_batched_tokens=budget), reqs, spy=True)
    for p, a, b in zip(ps, whole, chunked):
        assert compare(f"budget {budget}, prompt {len(p)}", b[0], b[1], a[0], a[1]) <= 1e-10


def test_preemption_equals_uninterrupted(hybrid64):
    P = 16
    ps = prompts([30, 45, 20, 60], seed=8)
    reqs = [(p, dict(max_new_tokens=40, temperature=0)) for p in ps]
    roomy = run(Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P), reqs)
    tight = Engine(hybrid64, kv_cache_tokens=8 * P, page_size=P)
    squeezed = run(tight, reqs)
    print("preemptions:", tight.stats["preemptions"])
    assert tight.stats["preemptions"] > 0
    assert [r[0] for r in squeezed] == [r[0] for r in roomy]


def test_abort_frees_the_state_slot(hybrid64):
    engine = Engine(hybrid64, kv_cache_tokens=512, page_size=16, max_batch_size=2)
    a = engine.add_request(prompts([40], seed=9)[0], max_new_tokens=50, temperature=0)
    b = engine.add_request(prompts([20], seed=10)[0], max_new_tokens=8, temperature=0)
    early = []
    for _ in range(3):
        early += [t for o in engine.step() if o.request_id == b for t in o.token_ids]
        engine.check()
    assert engine.states.free == []
    engine.abort(a)
    engine.check()
    assert len(engine.states.free) == 1
    c = engine.add_request(prompts([25], seed=13)[0], max_new_tokens=8, temperature=0)   # takes a's slot, fresh
    out = {b: early, c: []}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        engine.check()
    assert out[c] == alone(hybrid64, prompts([25], seed=13)[0], 8)[0]
    assert out[b] == alone(hybrid64, prompts([20], seed=10)[0], 8)[0]


def test_slot_bookkeeping_errors_name_what_broke(hybrid64):
    engine = Engine(hybrid64, kv_cache_tokens=512, page_size=16, max_batch_size=2)
    engine.add_request(prompts([10])[0], max_new_tokens=4, temperature=0)
    engine.step()
    engine.states.free.append(engine.scheduler.running[0].state_slot)
    with pytest.raises(npqwen.NpqwenError, match="state slot"):
        engine.check()


def test_the_kv_cache_holds_full_attention_layers_only(hybrid64):
    engine = Engine(hybrid64, kv_cache_tokens=256, page_size=16, max_batch_size=3)
    assert engine.kv.keys.shape[0] == 1                          # one full-attention layer of four
    assert engine.kv.states.recurrent.shape[:2] == (3, 3)        # three linear layers, a slot per request
    assert np.isfinite(engine.kv.nbytes)
