"""The engine: batched equals alone, prefix hit equals miss, chunked equals unchunked, preemption
equals an uninterrupted run, abort frees pages, a seed draws the same whatever the company, and the
page bookkeeping holds after every step."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine, NpqwenError
from npqwen.backend import to_numpy
from npqwen.generate import decode_one_token, prefill

from conftest import build_hf_checkpoint, tiny_config
from tolerance import EPS64, logprob_tolerance, relative_diff, rounding_tolerance, tolerance_of

pytest.importorskip("transformers")

LENGTHS = [1, 2, 5, 17, 31, 64, 100, 255, 256, 257, 512, 700]   # 12 prompts, 1 to 700 tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_hf_checkpoint(tmp_path_factory.mktemp("engine_tiny"), tiny_config(max_position_embeddings=1024),
                               std=0.1)


@pytest.fixture(scope="module")
def llm64(tiny_dir):
    return npqwen.load(tiny_dir, dtype="float64")


@pytest.fixture(scope="module")
def llm32(tiny_dir):
    return npqwen.load(tiny_dir, dtype="float32")


def prompts(lengths, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


class LogitSpy:
    """Wraps the model so a test sees the logits of every step (rows = the sampling requests, in order)."""

    def __init__(self, model):
        self.model, self.last = model, None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_batch(self, batch, kv, recorder=None):
        out = self.model.forward_batch(batch, kv, recorder)
        self.last = to_numpy(out.logits)
        return out


def run(engine, requests, spy=False, on_step=None):
    """Add every (prompt, kwargs) at once and step to the end, checking the page bookkeeping after
    every step. {request id: (tokens, [logits per sampled token], finish_reason)}."""
    if spy:
        engine.model = LogitSpy(engine.model)
    ids = [engine.add_request(p, **kw) for p, kw in requests]
    out = {i: ([], [], None) for i in ids}
    steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        engine.check()
        sampled = [o for o in outputs if o.token_ids]
        if spy:
            assert engine.model.last.shape[0] == len(sampled)    # logits only where a token is sampled
        for row, o in enumerate(sampled):
            tokens, logits, _ = out[o.request_id]
            tokens.extend(o.token_ids)
            if spy:
                logits.append(engine.model.last[row])
        for o in outputs:
            if o.finished:
                out[o.request_id] = (out[o.request_id][0], out[o.request_id][1], o.finish_reason)
        steps += 1
        if on_step is not None:
            on_step(engine, steps, outputs)
        assert steps < 10_000
    engine.check()
    assert engine.stats["kv_pages_free"] + engine.stats["kv_pages_cached"] == engine.stats["kv_pages_total"]
    return [out[i] for i in ids]


def alone(llm, prompt, n):
    """Greedy tokens and per-step logits of one prompt through the single-sequence path (prefill, decode_one_token)."""
    cache = llm.new_cache(len(prompt) + n)
    logits = [to_numpy(prefill(llm.model, prompt, cache))]
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        if len(tokens) < n:
            logits.append(to_numpy(decode_one_token(llm.model, tokens[-1], cache)))
    return tokens, logits


def compare(name, got_tokens, got_logits, want_tokens, want_logits):
    """Tokens equal; returns the largest relative logit difference (tests/tolerance.py's relative_diff). Two
    runs of the engine differ by rounding only: a batch of many blocks the same sums unlike a batch of one, a
    chunk or a prefix hit reads cached keys with a shorter matrix product, so the tests bound the difference
    by tolerance_of(llm, tokens) instead of asking for equality."""
    first = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens)) if a != b), None)
    err = max(relative_diff(a, b) for a, b in zip(got_logits, want_logits)) if got_logits else 0.0
    print(f"{name}: {len(got_tokens)} tokens, first mismatching token {first}, relative max |logit diff| {err:.2e}")
    assert got_tokens == want_tokens and first is None
    return err


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_batched_equals_alone(llm64, llm32, dtype):
    llm = llm64 if dtype == "float64" else llm32
    ps = prompts(LENGTHS)
    news = [3 + (7 * i) % 13 for i in range(len(ps))]
    engine = Engine(llm, kv_cache_tokens=16 * 200, page_size=16, max_batched_tokens=256)
    results = run(engine, [(p, dict(max_new_tokens=n, temperature=0)) for p, n in zip(ps, news)], spy=True)
    worst = 0.0
    for p, n, (tokens, logits, reason) in zip(ps, news, results):
        want_tokens, want_logits = alone(llm, p, n)
        worst = max(worst, compare(f"{dtype} prompt {len(p)}", tokens, logits, want_tokens, want_logits))
        assert reason == "length"
    assert worst <= tolerance_of(llm, max(LENGTHS) + max(news))


def test_generate_list_equals_each_alone(llm64):
    ps = prompts([3, 40, 300, 9], seed=1)
    together = llm64.generate(ps, max_new_tokens=6, temperature=0)
    assert [r.token_ids for r in together] == [llm64.generate(p, max_new_tokens=6, temperature=0).token_ids
                                                for p in ps]
    assert [r.prompt_tokens for r in together] == [3, 40, 300, 9]


def test_batched_equals_alone_qwen3_0_6b_shape(qwen3_0_6b_shape):
    llm = npqwen.load(qwen3_0_6b_shape)
    ps = prompts([3, 40, 130, 300], seed=2, vocab=151643)
    engine = Engine(llm, kv_cache_tokens=4096, page_size=64, max_batched_tokens=256)
    results = run(engine, [(p, dict(max_new_tokens=6, temperature=0)) for p in ps], spy=True)
    worst = max(compare(f"0.6B prompt {len(p)}", r[0], r[1], *alone(llm, p, 6)) for p, r in zip(ps, results))
    assert worst <= tolerance_of(llm, 300 + 6)


@pytest.mark.parametrize("budget", [7, 64, 512])
def test_chunked_equals_unchunked(llm64, budget):
    ps = prompts([600, 33, 200], seed=3)
    reqs = [(p, dict(max_new_tokens=5, temperature=0)) for p in ps]
    whole = run(Engine(llm64, kv_cache_tokens=4096, page_size=32, max_batched_tokens=2048), reqs, spy=True)
    chunked = run(Engine(llm64, kv_cache_tokens=4096, page_size=32, max_batched_tokens=budget), reqs, spy=True)
    for p, a, b in zip(ps, whole, chunked):
        assert compare(f"budget {budget}, prompt {len(p)}", b[0], b[1], a[0], a[1]) <= tolerance_of(llm64, 600 + 5)


def test_prefix_hit_equals_miss(llm64):
    P = 16
    shared = prompts([5 * P], seed=4)[0]
    first, second = shared + prompts([7], seed=5)[0], shared + prompts([20], seed=6)[0]
    kw = dict(max_new_tokens=5, temperature=0)
    engine = Engine(llm64, kv_cache_tokens=64 * P, page_size=P)
    run(engine, [(first, kw)])
    assert engine.stats["prefix_cache_hit_tokens"] == 0 and engine.stats["kv_pages_cached"] >= 5
    (hit, hit_logits, _), = run(engine, [(second, kw)], spy=True)
    assert engine.stats["prefix_cache_hit_tokens"] == 5 * P
    cold = Engine(llm64, kv_cache_tokens=64 * P, page_size=P, prefix_cache=False)
    (miss, miss_logits, _), = run(cold, [(second, kw)], spy=True)
    assert cold.stats["prefix_cache_hit_tokens"] == 0
    assert compare("prefix hit vs miss", hit, hit_logits, miss, miss_logits) <= tolerance_of(llm64, len(second) + 5)


def test_fully_cached_prompt_still_computes_its_last_token(llm64):
    P = 16
    prompt = prompts([3 * P], seed=7)[0]    # exactly three full pages
    engine = Engine(llm64, kv_cache_tokens=32 * P, page_size=P)
    (a, _, _), = run(engine, [(prompt, dict(max_new_tokens=4, temperature=0))])
    (b, _, _), = run(engine, [(prompt, dict(max_new_tokens=4, temperature=0))])
    assert a == b == alone(llm64, prompt, 4)[0]
    assert engine.stats["prefix_cache_hit_tokens"] == 2 * P    # the third page holds the last token: recomputed


def test_preemption_equals_uninterrupted(llm64):
    P = 16
    ps = prompts([30, 45, 20, 60], seed=8)
    reqs = [(p, dict(max_new_tokens=40, temperature=0)) for p in ps]
    roomy = run(Engine(llm64, kv_cache_tokens=64 * P, page_size=P), reqs)
    tight = Engine(llm64, kv_cache_tokens=8 * P, page_size=P)       # each fits alone (<= 7 pages), not all four
    squeezed = run(tight, reqs)
    print("preemptions:", tight.stats["preemptions"])
    assert tight.stats["preemptions"] > 0
    assert [r[0] for r in squeezed] == [r[0] for r in roomy]


def test_answers_past_the_pool_preempt_and_each_ends_as_it_would_alone(llm64):
    """Pages follow the tokens generated: requests whose max_new_tokens reach far past the pool (4 pages of
    16) are admitted by their prompts, preempt one another as they grow, and each ends as it does alone,
    where the whole pool is full ("length") or at its eos; a prompt the pool cannot hold is refused at once."""
    P = 16
    reqs = [(p, dict(max_new_tokens=10**6, temperature=0)) for p in prompts([20, 30, 12], seed=11)]
    tight = Engine(llm64, kv_cache_tokens=4 * P, page_size=P)
    together = run(tight, reqs)
    alone = [run(Engine(llm64, kv_cache_tokens=4 * P, page_size=P), [r])[0] for r in reqs]
    print("preemptions:", tight.stats["preemptions"], "lengths and reasons:", [(len(t), why) for t, _, why in together])
    assert tight.stats["preemptions"] > 0
    assert [(t, why) for t, _, why in together] == [(t, why) for t, _, why in alone]
    assert all(why == "stop" or len(p) + len(t) == 4 * P for (p, _), (t, _, why) in zip(reqs, together))
    with pytest.raises(NpqwenError, match=r"a prompt of 64 tokens needs 5 KV pages of 16 positions"):
        tight.add_request(prompts([64])[0], max_new_tokens=1)
    assert not tight.has_unfinished()


def test_abort_frees_its_pages_at_once(llm64):
    P = 16
    engine = Engine(llm64, kv_cache_tokens=32 * P, page_size=P, prefix_cache=False)
    a = engine.add_request(prompts([40], seed=9)[0], max_new_tokens=50, temperature=0)
    b = engine.add_request(prompts([70], seed=10)[0], max_new_tokens=50, temperature=0)
    for _ in range(3):
        engine.step()
    held = len(engine.requests[b].page_table)
    free = engine.stats["kv_pages_free"]
    out = engine.abort(b)
    engine.check()
    assert (out.finished, out.finish_reason) == (True, "abort") and held == 5
    assert engine.stats["kv_pages_free"] == free + held and engine.stats["running"] == 1
    later = [o.request_id for _ in range(3) for o in engine.step()]
    assert later == [a] * 3
    with pytest.raises(NpqwenError, match="no unfinished request"):
        engine.abort(b)


def test_same_seed_same_tokens_whatever_the_company(llm64):
    prompt = prompts([12], seed=11)[0]
    kw = dict(max_new_tokens=20, temperature=0.9, top_k=50, seed=1234)
    (solo, _, _), = run(Engine(llm64, kv_cache_tokens=4096, page_size=16), [(prompt, kw)])
    company = [(p, dict(max_new_tokens=25, temperature=1.0, seed=i)) for i, p in enumerate(prompts([5, 80, 33], 12))]
    crowd = run(Engine(llm64, kv_cache_tokens=4096, page_size=16, max_batched_tokens=48),
                company[:2] + [(prompt, kw)] + company[2:])
    assert crowd[2][0] == solo and len(solo) == 20
    assert crowd[0][0] != solo[:len(crowd[0][0])]


def test_new_requests_join_at_once_and_a_long_prompt_never_freezes_the_others(llm64):
    engine = Engine(llm64, kv_cache_tokens=4096, page_size=16, max_batched_tokens=32)
    first = [engine.add_request(p, max_new_tokens=30, temperature=0) for p in prompts([4, 6], seed=13)]
    for _ in range(3):
        engine.step()
    late = engine.add_request(prompts([700], seed=14)[0], max_new_tokens=3, temperature=0)
    for _ in range(10):   # the 700-token prompt takes ~22 steps of 30 tokens; the others decode every step
        outs = {o.request_id: o for o in engine.step()}
        engine.check()
        assert all(len(outs[r].token_ids) == 1 for r in first)
        assert late in outs and outs[late].token_ids == []     # it reads its prompt beside them
        assert engine.stats["running"] == 3


def test_finished_requests_free_their_pages_at_once(llm64):
    engine = Engine(llm64, kv_cache_tokens=4096, page_size=16, prefix_cache=False)
    short = engine.add_request(prompts([20], seed=15)[0], max_new_tokens=2, temperature=0)
    engine.add_request(prompts([20], seed=16)[0], max_new_tokens=20, temperature=0)
    while short in engine.requests:
        engine.step()
    assert engine.stats["kv_pages_free"] == engine.stats["kv_pages_total"] - 2 and engine.stats["running"] == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), "top_p must be in"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(seed=-3), "seed must be a non-negative integer"),
])
def test_bad_values_are_refused_at_add_request(llm64, kwargs, message):
    engine = Engine(llm64, kv_cache_tokens=1024, page_size=16)
    with pytest.raises(NpqwenError, match=message):
        engine.add_request([1, 2, 3], **kwargs)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompt, message", [([], "the prompt is empty"), ([1, 512], "outside the vocabulary"),
                                             ([[1, 2], [3]], "1-D sequence"), (None, "1-D sequence")])
def test_bad_prompts_are_refused_at_add_request(llm64, prompt, message):
    engine = Engine(llm64, kv_cache_tokens=1024, page_size=16)
    with pytest.raises(NpqwenError, match=message):
        engine.add_request(prompt)


@pytest.mark.parametrize("kwargs", [dict(page_size=0), dict(max_batch_size=1.5), dict(kv_cache_tokens=3),
                                    dict(max_batched_tokens=True)])
def test_bad_engine_sizes(llm64, kwargs):
    with pytest.raises(NpqwenError, match="must be an integer"):
        Engine(llm64, **kwargs)


def test_stats_and_stream_text(tmp_path):
    llm = npqwen.load("tiny")
    engine = Engine(llm, kv_cache_tokens=2048, page_size=16)
    rid = engine.add_request("Hello there", max_new_tokens=12, temperature=0)
    assert engine.stats["waiting"] == 1 and engine.stats["running"] == 0
    text = ""
    while engine.has_unfinished():
        for o in engine.step():
            text += o.text
            final = o
    assert final.request_id == rid and final.finished and final.result.text == text
    assert text == llm.generate("Hello there", max_new_tokens=12, temperature=0).text
    assert set(engine.stats) >= {"running", "waiting", "kv_pages_total", "kv_pages_free", "prefix_cache_hit_tokens",
                                 "preemptions"}


def test_eviction_takes_the_end_of_a_cached_prefix_first(llm64):
    P = 16
    engine = Engine(llm64, kv_cache_tokens=6 * P, page_size=P)
    a = prompts([3 * P + 1], seed=17)[0]                     # three full pages, then one more position
    run(engine, [(a, dict(max_new_tokens=2, temperature=0))])
    assert engine.stats["kv_pages_cached"] == 3
    run(engine, [(prompts([4 * P], seed=18)[0], dict(max_new_tokens=1, temperature=0))])   # takes 1 cached page
    hits = engine.stats["prefix_cache_hit_tokens"]
    run(engine, [(a, dict(max_new_tokens=2, temperature=0))])
    assert engine.stats["prefix_cache_hit_tokens"] - hits == 2 * P   # the first two pages survived


def test_a_request_that_must_wait_for_pages_leaves_the_prefix_cache_alone(llm64):
    P = 16
    engine = Engine(llm64, kv_cache_tokens=8 * P, page_size=P, max_batched_tokens=8 * P)
    cached = prompts([2 * P + 1], seed=19)[0]
    run(engine, [(cached, dict(max_new_tokens=1, temperature=0))])          # leaves 2 cached pages
    engine.add_request(prompts([4 * P], seed=20)[0], max_new_tokens=P, temperature=0)
    engine.step()                                                            # holds 5 of the 8 pages
    engine.add_request(prompts([4 * P], seed=21)[0], max_new_tokens=P, temperature=0)
    engine.step()                                                            # cannot fit: it waits
    engine.check()
    assert engine.stats["waiting"] == 1 and engine.stats["kv_pages_cached"] == 2


def test_a_stream_never_iterated_costs_nothing(llm64):
    s = llm64.stream([1, 2, 3], max_new_tokens=5, temperature=0)
    assert not llm64.engine.has_unfinished()
    del s
    assert llm64.generate([4, 5], max_new_tokens=3, temperature=0).token_ids and not llm64._inbox


def test_a_stream_closed_early_frees_its_request():
    llm = npqwen.load("tiny")
    s = llm.stream("Hello", max_new_tokens=50, temperature=0)
    assert next(s) and llm.engine.has_unfinished()
    s.close()
    assert not llm.engine.has_unfinished() and not llm._inbox
    assert llm.engine.stats["kv_pages_free"] + llm.engine.stats["kv_pages_cached"] == llm.engine.stats["kv_pages_total"]


def test_the_one_loop_yields_its_requests_keeps_the_others_and_aborts_when_left():
    from npqwen.engine.run import run as run_requests

    llm = npqwen.load("tiny")
    engine = Engine(llm, kv_cache_tokens=1024, page_size=16)
    ours = [engine.new_request(p, max_new_tokens=n, temperature=0) for p, n in (("Hi", 3), ("Hello", 5))]
    loop = run_requests(engine, ours, inbox := {})
    assert not engine.has_unfinished()                    # nothing joins until the loop is iterated
    other = engine.add_request("Hey", max_new_tokens=40, temperature=0)
    outputs = list(loop)
    assert {o.request_id for o in outputs} == {r.request_id for r in ours}
    assert [len(o.result.token_ids) for o in outputs if o.finished] == [3, 5]
    assert inbox and set(inbox) == {other}                # another caller's outputs wait for it
    loop = run_requests(engine, [engine.new_request("Hi", max_new_tokens=50, temperature=0)], inbox)
    next(loop)
    loop.close()                                          # left early: the request is aborted
    assert set(engine.requests) == {other}
    engine.abort(other)
    assert engine.stats["kv_pages_free"] + engine.stats["kv_pages_cached"] == engine.stats["kv_pages_total"]


def test_decode_attention_for_many_sequences_equals_one_at_a_time():
    from npqwen import ops

    rng = np.random.default_rng(22)
    N, K, P, Dh, H = 12, 2, 8, 16, 4
    keys, values = (rng.standard_normal((N, K, P, Dh)) for _ in range(2))
    tables = [np.array([3, 7, 1]), np.array([0]), np.array([11, 5])]
    lengths = [19, 8, 9]                                  # the last page full, one position in it, partial
    q = rng.standard_normal((3, H, Dh))
    together, _ = ops.paged_decode_attention(q, keys, values, tables, lengths)
    for b, (table, S) in enumerate(zip(tables, lengths)):
        alone, _ = ops.paged_attention(q[b:b + 1], keys, values, table, start=S - 1)
        err = relative_diff(together[b], alone[0])
        print(f"sequence {b}: relative max |diff| {err:.1e}")
        assert err <= rounding_tolerance(max(Dh, S), 2, EPS64)   # float64 sums of Dh (q.k) then of S (p.v)


def prompt_scores(engine, requests, on_step=None) -> list[list]:
    """Add every (prompt, kwargs) with prompt_logprobs and step to the end; each request's prompt
    logprobs entries, in the order they came."""
    ids = [engine.add_request(p, **kw) for p, kw in requests]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.prompt_logprobs or []
        engine.check()
        if on_step is not None:
            on_step(engine)
    return [got[i] for i in ids]


def forward_logprobs(llm, ids) -> np.ndarray:
    """log p(ids[j + 1] | ids[:j + 1]) from one forward pass of the whole sequence (T - 1,), and the log-softmax."""
    logits = np.asarray(to_numpy(llm.forward(ids)), np.float64)
    logp = logits - logits.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]], logp


def test_prompt_logprobs_chunked_cached_and_preempted_equal_one_forward_pass(llm64):
    """Each prompt position scored exactly once, whatever the chunking, the prefix cache (a cached
    page computes no logits, so a scoring request reuses none it has not scored) or a preemption."""
    P = 16
    ps = prompts([30, 45, 20, 60, 1], seed=8)
    want = [forward_logprobs(llm64, p) for p in ps]
    kw = dict(max_new_tokens=40, temperature=0, prompt_logprobs=3)
    chunked = Engine(llm64, kv_cache_tokens=64 * P, page_size=P, max_batched_tokens=24)
    chunked.add_request(ps[3], max_new_tokens=1, temperature=0)   # its pages are cached before the scoring run
    while chunked.has_unfinished():
        chunked.step()
    tight = Engine(llm64, kv_cache_tokens=8 * P, page_size=P)
    for engine in (chunked, tight):
        got = prompt_scores(engine, [(p, kw) for p in ps])
        for p, g, (w, logp) in zip(ps, got, want):
            assert len(g) == len(p) - 1, (len(g), len(p))
            err = np.abs(np.array([lp for lp, _, _ in g]) - w).max() if g else 0.0
            print(f"prompt of {len(p)} tokens: max |logprob diff| {err:.2e}")
            assert err <= logprob_tolerance(llm64.config, len(p), logp, EPS64)   # float64, chunked or not
            for j, (lp, top, rank) in enumerate(g):   # the alternatives and the rank, from the same rows
                best = np.argsort(-logp[j], kind="stable")[:3]
                assert [t for t, _ in top] == best.tolist() and np.allclose([l for _, l in top], logp[j][best])
                assert rank == 1 + int((logp[j] > logp[j][p[j + 1]]).sum())
    assert chunked.stats["prefix_cache_hit_tokens"] == 0          # the cached pages of ps[3] were not skipped
    assert tight.stats["preemptions"] > 0


def test_a_probe_equals_a_trace_and_samples_nothing(llm64):
    """A probe (the web page's attention): its prompt is read a chunk per step beside another
    request, its last token alone with its recorder, which sees that token's steps."""
    from npqwen.trace import Trace

    P = 16
    ids = prompts([100], seed=9)[0]
    trace = Trace()
    llm64.forward(ids, recorder=trace)
    engine = Engine(llm64, kv_cache_tokens=32 * P, page_size=P, max_batched_tokens=32)
    probe = engine.new_request(ids, 1, temperature=0)
    seen = {}
    probe.probe = lambda name, array: seen.setdefault(name, to_numpy(array))
    engine.add(probe)
    other = engine.add_request(prompts([10], seed=10)[0], max_new_tokens=8, temperature=0)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        engine.check()
    mine = [o for o in outputs if o.request_id == probe.request_id]
    assert all(not o.token_ids for o in mine) and mine[-1].finished and len(mine) == 5   # 4 chunks of 32, then alone
    want = trace["model.layers.1.self_attn.attn_probs"][:, -1, :]                        # (H, 100)
    # float64; the last token alone against the whole prompt at once: the same sums, blocked otherwise
    assert relative_diff(seen["model.layers.1.self_attn.attn_probs"][:, 0], want) <= tolerance_of(llm64, 100, 2)
    assert relative_diff(seen["lm_head"], trace["lm_head"][-1:]) <= tolerance_of(llm64, 100)   # (1, V): the last token's
    assert sum(len(o.token_ids) for o in outputs if o.request_id == other) == 8
