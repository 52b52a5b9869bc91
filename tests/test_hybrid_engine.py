"""Qwen3.5 in the engine: batched equals alone token for token (chunked prompts, preemption, abort),
with the state slots' bookkeeping checked after every step; the prefix cache with its state snapshots
(a hit equals a miss, mid-prompt and chunked, preempted, evicted, aborted, prefill-only requests)."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine

from hybrid_checkpoints import QWEN3_5_0_8B_TEXT, build_hybrid_checkpoint, hybrid_config
from test_engine import alone, compare, prompts, run
from tolerance import rounding_tolerance, tolerance_of

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
    assert worst <= tolerance_of(hybrid64, 300 + max(news))
    assert engine.stats["prefix_cache_hit_tokens"] == 0 and len(engine.states.free) == 5


@pytest.mark.parametrize("budget", [7, 64])
def test_chunked_prompt_equals_whole(hybrid64, budget):
    ps = prompts([300, 33, 150], seed=12)
    reqs = [(p, dict(max_new_tokens=5, temperature=0)) for p in ps]
    whole = run(Engine(hybrid64, kv_cache_tokens=2048, page_size=32, max_batched_tokens=1024), reqs, spy=True)
    chunked = run(Engine(hybrid64, kv_cache_tokens=2048, page_size=32, max_batched_tokens=budget), reqs, spy=True)
    for p, a, b in zip(ps, whole, chunked):
        assert compare(f"budget {budget}, prompt {len(p)}", b[0], b[1], a[0], a[1]) <= tolerance_of(hybrid64, 300 + 5)


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


# -- the prefix cache: a hit restores the linear layers' states from a snapshot (engine/state_snapshots.py) --

def hits(engine) -> int:
    return engine.stats["prefix_cache_hit_tokens"]


def test_prefix_hit_equals_miss(hybrid64):
    P = 16
    shared = prompts([5 * P], seed=4)[0]
    first, second = shared + prompts([7], seed=5)[0], shared + prompts([20], seed=6)[0]
    kw = dict(max_new_tokens=6, temperature=0)
    engine = Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P)
    run(engine, [(first, kw)])
    assert hits(engine) == 0 and engine.stats["state_snapshots"] == 1   # after first's 5 full pages of prompt
    (hit, hit_logits, _), = run(engine, [(second, kw)], spy=True)
    print("prefix hit tokens:", hits(engine))
    assert hits(engine) == 5 * P
    cold = Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P, prefix_cache=False)
    (miss, miss_logits, _), = run(cold, [(second, kw)], spy=True)
    assert hits(cold) == 0 and cold.stats["state_snapshots"] == 0
    assert compare("hybrid prefix hit vs miss", hit, hit_logits, miss, miss_logits) <= tolerance_of(hybrid64, len(second) + 6)
    assert hit == alone(hybrid64, second, 6)[0]


@pytest.mark.parametrize("budget", [24, 512])
def test_a_shared_system_prompt_hits_mid_prompt_from_the_third_request_on(hybrid64, budget):
    """The first request leaves a snapshot at its own last full page, past the shared part; the second
    finds the shared pages cached without a snapshot, so it ends a chunk there and leaves one; the
    third resumes there, in the middle of its prompt, and reads the rest in chunks."""
    P = 16
    system = prompts([3 * P + 5], seed=21)[0]                    # the shared part ends inside page 4
    ps = [system + tail for tail in prompts([40, 29, 57, 33], seed=22)]
    kw = dict(max_new_tokens=5, temperature=0)
    engine = Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P, max_batched_tokens=budget)
    cold = Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P, max_batched_tokens=budget, prefix_cache=False)
    seen = []
    for p in ps:   # one after another: each finds what the ones before it left
        (got, got_logits, _), = run(engine, [(p, kw)], spy=True)
        seen.append(hits(engine))
        (want, want_logits, _), = run(cold, [(p, kw)], spy=True)
        assert compare(f"budget {budget}, request {len(seen)}", got, got_logits, want, want_logits) \
            <= tolerance_of(hybrid64, len(p) + 5)
    print(f"budget {budget}: cumulative hit tokens after each request {seen}")
    assert seen == [0, 0, 3 * P, 6 * P]
    together = run(Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P, max_batched_tokens=budget),
                   [(p, kw) for p in ps])    # all at once: the same tokens whatever hits
    assert [r[0] for r in together] == [alone(hybrid64, p, 5)[0] for p in ps]


def test_preempted_requests_with_prefix_hits_equal_uninterrupted(hybrid64):
    P = 16
    system = prompts([2 * P], seed=30)[0]
    ps = [system + tail for tail in prompts([14, 29, 4, 44], seed=31)]
    reqs = [(p, dict(max_new_tokens=40, temperature=0)) for p in ps]
    roomy = run(Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P, prefix_cache=False), reqs)
    tight = Engine(hybrid64, kv_cache_tokens=8 * P, page_size=P)
    run(tight, [(system + [7], dict(max_new_tokens=1, temperature=0))])   # leaves the system prompt's snapshot
    squeezed = run(tight, reqs)
    print("preemptions:", tight.stats["preemptions"], "prefix hit tokens:", hits(tight))
    assert tight.stats["preemptions"] > 0 and hits(tight) >= 4 * 2 * P
    assert [r[0] for r in squeezed] == [r[0] for r in roomy]



def test_n_choices_of_one_prompt_share_its_prefix(hybrid64):
    """The server's n choices: the followers wait for the leader to read the prompt, then hit the
    snapshot it left at the prompt's last full page before its last token."""
    P = 16
    prompt = prompts([4 * P + 9], seed=35)[0]
    outs = {}
    for cache in (True, False):
        engine = Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P, max_batched_tokens=32, prefix_cache=cache)
        reqs = [engine.new_request(prompt, max_new_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3)]
        for req in reqs[1:]:
            req.leader = reqs[0]
        tokens = {engine.add(req): [] for req in reqs}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.token_ids
            engine.check()
        outs[cache] = (list(tokens.values()), hits(engine))
    print("n choices: prefix hit tokens", outs[True][1], "tokens", outs[True][0])
    assert outs[True][1] == 2 * 4 * P and outs[False][1] == 0
    assert outs[True][0] == outs[False][0]

def test_a_small_snapshot_pool_evicts_and_stays_correct(hybrid64):
    P = 16
    shared = prompts([2 * P, 3 * P, 4 * P], seed=40)
    firsts = [s + [1, 2, 3] for s in shared]
    seconds = [s + t for s, t in zip(shared, prompts([9, 12, 5], seed=41))]
    kw = dict(max_new_tokens=4, temperature=0)
    counts = {}
    for n in (3, 1, 0):
        engine = Engine(hybrid64, kv_cache_tokens=64 * P, page_size=P, state_snapshots=n)
        run(engine, [(p, kw) for p in firsts])
        assert engine.stats["state_snapshots"] == n               # one per prompt, as many as fit
        got = run(engine, [(p, kw) for p in seconds])
        counts[n] = hits(engine)
        assert [r[0] for r in got] == [alone(hybrid64, p, 4)[0] for p in seconds]
    print("prefix hit tokens by snapshot pool size:", counts)
    assert counts == {3: 9 * P, 1: 4 * P, 0: 0}                 # pool of 1: the last prompt's snapshot survived


def test_a_page_evicted_takes_its_snapshot_with_it(hybrid64):
    P = 16
    a = prompts([3 * P + 1], seed=17)[0]
    engine = Engine(hybrid64, kv_cache_tokens=6 * P, page_size=P)
    run(engine, [(a, dict(max_new_tokens=2, temperature=0))])
    assert engine.stats["kv_pages_cached"] == 3 and engine.stats["state_snapshots"] == 1
    run(engine, [(prompts([4 * P], seed=18)[0], dict(max_new_tokens=1, temperature=0))])   # evicts a's last page
    assert engine.stats["state_snapshots"] == 1                   # b's own; a's went with its page
    (again, _, _), = run(engine, [(a, dict(max_new_tokens=2, temperature=0))])
    assert hits(engine) == 0 and again == alone(hybrid64, a, 2)[0]   # a's first two pages have no snapshot


def test_abort_keeps_the_snapshots_and_the_bookkeeping(hybrid64):
    P = 16
    system = prompts([4 * P], seed=50)[0]
    engine = Engine(hybrid64, kv_cache_tokens=32 * P, page_size=P, max_batched_tokens=2 * P, max_batch_size=2)
    a = engine.add_request(system + [5, 6], max_new_tokens=30, temperature=0)
    for _ in range(3):             # two chunks of its prompt, its snapshot after page 4, then a token
        engine.step()
        engine.check()
    assert engine.stats["state_snapshots"] == 1
    engine.abort(a)
    engine.check()
    b = engine.add_request(system + [9], max_new_tokens=6, temperature=0)   # hits a's prefix, then is aborted
    engine.step()
    engine.check()
    assert hits(engine) == 4 * P and len(engine.states.free) == 1
    engine.abort(b)
    engine.check()
    tail = prompts([11], seed=51)[0]
    (got, _, _), = run(engine, [(system + tail, dict(max_new_tokens=6, temperature=0))])
    print("prefix hit tokens:", hits(engine))
    assert hits(engine) == 8 * P and got == alone(hybrid64, system + tail, 6)[0]


def test_prefill_only_requests_hit_the_prefix_cache_and_equal_a_miss(hybrid64):
    P = 16
    system = prompts([3 * P], seed=60)[0]
    texts = [system + tail for tail in prompts([10, 20], seed=61)]
    results = {}
    for cache in (True, False):
        engine = Engine(hybrid64, kv_cache_tokens=32 * P, page_size=P, prefix_cache=cache)
        run(engine, [(system + [3], dict(max_new_tokens=1, temperature=0))])
        reqs = [engine.new_embedding_request(texts[0]), engine.new_scoring_request(texts[1], [3, 4]),
                engine.new_embedding_request(texts[0], "mean")]       # mean pooling reads every position
        outs = {}
        for req in reqs:
            engine.add(req)
            while engine.has_unfinished():
                outs.update({o.request_id: o for o in engine.step() if o.finished})
                engine.check()
        results[cache] = ([outs[r.request_id] for r in reqs], hits(engine))
    (hit, n_hit), (miss, n_miss) = results[True], results[False]
    print("prefix hit tokens, prefill-only:", n_hit, n_miss)
    assert n_hit == 2 * 3 * P and n_miss == 0
    for name, a, b in (("lasttoken", hit[0].embedding, miss[0].embedding), ("scores", hit[1].scores, miss[1].scores),
                       ("mean", hit[2].embedding, miss[2].embedding)):
        err = float(np.abs(a - b).max() / np.abs(b).max())
        print(f"{name}: max |hit - miss| / max |miss| {err:.2e}")
        # float32 outputs of a float64 model, rounded once (mean: a float32 running sum over the prompt's positions)
        assert err <= rounding_tolerance(len(texts[0]) if name == "mean" else 1)


def test_prefix_hit_equals_miss_qwen3_5_0_8b_shape(tmp_path):
    """Qwen3.5-0.8B's text shape (its first 4 layers: 3 linear, 1 full), float32: a second request sharing
    3 pages of 64 resumes from the first one's snapshot (3.2 MiB for these 3 linear layers; 19.3 MiB for 18)."""
    config = {"model_type": "qwen3_5_text", **QWEN3_5_0_8B_TEXT, "num_hidden_layers": 4}
    llm = npqwen.load(build_hybrid_checkpoint(tmp_path, config, save_dtype="bfloat16", std=0.02))
    P = 64
    shared = prompts([3 * P], seed=80, vocab=248044)[0]
    first, second = shared + prompts([10], seed=81, vocab=248044)[0], shared + prompts([30], seed=82, vocab=248044)[0]
    kw = dict(max_new_tokens=6, temperature=0)
    engine = Engine(llm, kv_cache_tokens=16 * P, page_size=P, max_batch_size=2)
    run(engine, [(first, kw)])
    (hit, hit_logits, _), = run(engine, [(second, kw)], spy=True)
    cold = Engine(llm, kv_cache_tokens=16 * P, page_size=P, max_batch_size=2, prefix_cache=False)
    (miss, miss_logits, _), = run(cold, [(second, kw)], spy=True)
    snapshot = engine.cache.snapshots.store.nbytes // engine.cache.snapshots.num_slots
    print("0.8B shape: prefix hit tokens", hits(engine), "snapshot bytes", snapshot)
    assert hits(engine) == 3 * P and snapshot == 3 * 1_122_304 == 3 * 20_201_472 // 18
    assert compare("0.8B shape, prefix hit vs miss", hit, hit_logits, miss, miss_logits) <= tolerance_of(llm, len(second) + 6)


def test_snapshot_bookkeeping_errors_name_what_broke(hybrid64):
    P = 16
    engine = Engine(hybrid64, kv_cache_tokens=32 * P, page_size=P, state_snapshots=2)
    run(engine, [(prompts([2 * P + 3], seed=70)[0], dict(max_new_tokens=1, temperature=0))])
    snapshots = engine.cache.snapshots
    snapshots.free.append(next(iter(snapshots.by_hash.values())))
    with pytest.raises(npqwen.NpqwenError, match="state snapshot slots both free and held"):
        engine.check()
    snapshots.free.pop()
    snapshots.by_hash[12345] = snapshots.free.pop()
    with pytest.raises(npqwen.NpqwenError, match="no longer knows"):
        engine.check()


def test_state_snapshots_must_be_a_count(hybrid64):
    with pytest.raises(npqwen.NpqwenError, match="state_snapshots must be an integer >= 0"):
        Engine(hybrid64, kv_cache_tokens=256, page_size=16, state_snapshots=-1)
