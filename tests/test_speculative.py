"""Speculative decoding (npqwen/speculative.py, Engine.propose / accept): greedy output token for token
the output without drafts (tiny, tiny-moe, tiny-qwen3.5; batched with requests that do not speculate;
chunked prefill, preemption, the prefix cache), the bookkeeping checked after every step; sampling with
drafts draws from the model's own distribution (a chi-square test over thousands of seeds, and the same
test catching a wrong rule)."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine, NpqwenError, SamplingParams
from npqwen.hooks import SPECULATIVE
from npqwen.sampling import candidates
from npqwen.speculative import accept_or_replace, propose_ngram, speculative_of

stats = pytest.importorskip("scipy.stats")


def test_propose_ngram():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    assert propose_ngram(tokens, 3, n_max=2) == [9, 2, 5]       # "5 6": its latest earlier place wins
    assert propose_ngram(tokens, 3, n_max=3) == [9, 2, 5]       # no earlier "2 5 6": the 2-gram
    assert propose_ngram(tokens + [4], 3) == []                 # 4 never came before
    assert propose_ngram([3, 3], 2) == [3]                      # only what exists after the match
    assert propose_ngram([7], 2) == []


def test_speculative_values_are_checked():
    assert SamplingParams(speculative={"method": "ngram", "k": 2}).speculative.k == 2
    assert speculative_of({"method": "ngram", "num_speculative_tokens": 3}).num_speculative_tokens == 3
    for bad, says in [({"method": "eagle"}, "method must be one of"), ({"method": "ngram", "k": 0}, r"in \[1, 64\]"),
                      ({"method": "ngram", "kk": 1}, "unknown field"), ("ngram", "must be a dict"),
                      ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min")]:
        with pytest.raises(NpqwenError, match=says):
            SamplingParams(speculative=bad)


def oracle(llm, corrupt: float = 0.0, seed: int = 0):
    """A proposer whose drafts are the model's own greedy continuation (every one kept), each replaced by a
    random token with probability `corrupt`: the acceptance an oracle gives, 100% down."""
    rng = np.random.default_rng(seed)
    memo = {}

    def propose(engine, req):
        if req.params.speculative is None or req.uncomputed != 1:
            return []
        k = min(req.params.speculative.k, req.max_new_tokens - len(req.output_ids) - 1)
        key = tuple(req.tokens)
        if key not in memo:
            ids, drafts = list(req.tokens), []
            for _ in range(8):
                drafts.append(int(np.argmax(llm.model.forward(ids, last_only=True)[-1])))
                ids.append(drafts[-1])
            memo[key] = drafts
        return [int(rng.integers(llm.config.vocab_size)) if rng.random() < corrupt else t for t in memo[key][:k]]
    return propose


def continuation(prompts, answers, vocab: int, corrupt: float, seed: int = 0):
    """The oracle from answers already known (decoding without drafts): the drafts are what followed,
    each replaced by a random token with probability `corrupt`."""
    rng, known = np.random.default_rng(seed), {tuple(p): a for p, a in zip(prompts, answers)}

    def propose(engine, req):
        if req.params.speculative is None or req.uncomputed != 1:
            return []
        have = len(req.output_ids)
        drafts = known[tuple(req.prompt_ids)][have:have + min(req.params.speculative.k, req.max_new_tokens - have - 1)]
        return [int(rng.integers(vocab)) if rng.random() < corrupt else t for t in drafts]
    return propose


def generate(llm, prompts, spec, propose=None, **engine_args):
    """Every prompt at once, the even ones speculating; (tokens per prompt, engine)."""
    engine = Engine(llm, **{"page_size": 16, "max_batched_tokens": 64, **engine_args})
    if propose is not None:
        engine.propose = lambda req: propose(engine, req)
    ids = [engine.add_request(p, max_new_tokens=40, temperature=0, speculative=spec if i % 2 == 0 else None)
           for i, p in enumerate(prompts)]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
        engine.check()
    return [out[i] for i in ids], engine


def first_difference(a, b) -> str:
    for n, (x, y) in enumerate(zip(a, b)):
        if x != y:
            i = next(j for j in range(len(x)) if j >= len(y) or x[j] != y[j])
            return f"prompt {n}: token {i}: {x[i - 2:i + 3]} without drafts, {y[i - 2:i + 3]} with"
    return "none"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-qwen3.5"])
def test_greedy_equals_decoding_without_drafts(name):
    llm = npqwen.load(name)
    rng = np.random.default_rng(1)
    # repeated text (prompt lookup finds it) and random text; 130 tokens: chunked over 3 steps
    prompts = [list(range(65, 75)) * 4, rng.integers(0, 256, 130).tolist(), rng.integers(0, 256, 17).tolist(),
               [72, 101, 108, 108, 111, 32] * 5]
    plain, _ = generate(llm, prompts, None, kv_cache_tokens=4096)
    V = llm.config.vocab_size
    for spec, propose, args in [({"method": "ngram", "k": 4}, None, {}),
                                ({"method": "ngram", "k": 3}, continuation(prompts, plain, V, 0.3), {}),
                                ({"method": "ngram", "k": 5}, continuation(prompts, plain, V, 0.1),
                                 {"kv_cache_tokens": 11 * 16})]:
        drafted, engine = generate(llm, prompts, spec, propose, **{"kv_cache_tokens": 4096, **args})
        counts = {k: v for k, v in engine.stats.items() if k.startswith("spec") or k == "preemptions"}
        print(name, spec, "oracle" if propose else "", counts)
        assert drafted == plain, first_difference(plain, drafted)
        assert counts["spec_decode_num_accepted_tokens"] < counts["spec_decode_num_draft_tokens"]
        if propose is not None:   # some drafts kept and some refused: both roll-backs ran
            assert counts["spec_decode_num_accepted_tokens"] > 0
        if "kv_cache_tokens" in args:
            assert counts["preemptions"] > 0


def test_prefix_cache_and_step_log():
    llm = npqwen.load("tiny")
    prompt = list(range(65, 75)) * 6
    engine = Engine(llm, kv_cache_tokens=2048, page_size=16, record_steps=True)
    engine.propose = lambda req: oracle(llm, 0.5)(engine, req)
    outs = []
    for _ in range(2):   # the second finds the first's pages
        rid = engine.add_request(prompt, max_new_tokens=30, temperature=0, speculative={"method": "ngram", "k": 4})
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
            engine.check()
        outs.append(tokens)
    assert outs[0] == outs[1] == llm.generate(prompt, max_new_tokens=30, temperature=0).token_ids
    assert engine.stats["prefix_cache_hit_tokens"] >= 48
    rows = [r for step in engine.step_log for r in step if r.draft_tokens]
    assert rows and all(r.decode_tokens == 1 and 0 <= r.accepted_tokens <= r.draft_tokens == len(r.drafts)
                        for r in rows)
    kept = [t for r in rows for t in r.drafts[:r.accepted_tokens]]   # every kept draft is in the answers
    assert kept and all(t in outs[0] for t in kept)
    assert sum(r.accepted_tokens for r in rows) == engine.stats["spec_decode_num_accepted_tokens"]


def sequence_distribution(llm, prompt, params, length):
    """{generated tokens: probability} for every sequence of `length` tokens under params' distribution
    (top_k keeps the tree small): the law sampling without drafts follows."""
    law = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, p in law.items():
            logits = llm.model.forward(prompt + list(seq), last_only=True)[-1]
            ids, x = candidates(logits, params)
            q = np.exp(x - x.max())
            for i, qi in zip(ids, q / q.sum()):
                grown[seq + (int(i),)] = p * qi
        law = grown
    return law


def chi_square(law, samples):
    """The chi-square test of samples against law, cells with fewer than 5 expected pooled: (statistic, p)."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    big = [s for s, p in law.items() if p * n >= 5]
    observed = [counts.get(s, 0) for s in big] + [n - sum(counts.get(s, 0) for s in big)]
    expected = [law[s] * n for s in big] + [n * (1 - sum(law[s] for s in big))]
    return stats.chisquare(observed, expected)


def sample_with_drafts(llm, prompt, params, seeds, propose):
    engine = Engine(llm, kv_cache_tokens=1 << 15, page_size=8, max_batch_size=512, max_batched_tokens=4096)
    engine.propose = lambda req: propose(engine, req)
    out = {}
    for seed in seeds:
        out[engine.add_request(prompt, SamplingParams(**{**params, "seed": seed}))] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return [tuple(t) for t in out.values()]


def test_sampling_with_drafts_keeps_the_distribution(monkeypatch):
    llm = npqwen.load("tiny")
    prompt = [72, 101, 108, 108, 111]
    params = dict(max_new_tokens=3, temperature=1.5, top_k=3, top_p=1.0, min_p=0.0,
                  speculative={"method": "ngram", "k": 2})
    law = sequence_distribution(llm, prompt, SamplingParams(**params), 3)
    # drafts: the greedy continuation, the second one often a token of lower probability
    propose = oracle(llm, corrupt=0.3, seed=5)
    samples = sample_with_drafts(llm, prompt, params, range(1500), propose)
    statistic, p = chi_square(law, samples)
    print(f"chi-square {statistic:.1f} over {len(law)} sequences, p = {p:.3f}")
    assert p > 1e-3
    # the same test catches a wrong rule: keeping every draft that is a candidate at all
    wrong = lambda ids, x, draft, greedy, rng, draw: ((draft, True) if draft is not None and draft in ids
                                                      else accept_or_replace(ids, x, draft, greedy, rng, draw))
    monkeypatch.setattr("npqwen.engine.engine.accept_or_replace", wrong)
    statistic, p_wrong = chi_square(law, sample_with_drafts(llm, prompt, params, range(400), propose))
    print(f"keeping every draft: chi-square {statistic:.1f}, p = {p_wrong:.2g}")
    assert p_wrong < 1e-6


def test_bench_suite_measures_on_the_tiny_model():
    from tools.bench import speculative as suite

    llm = npqwen.load("tiny")
    times = suite.verify_times(llm, context=16, ks=[1, 2, 3], steps=2)
    out = {**{f"spec_verify_{n}_s": t for n, t in times.items()}, **suite.speedups(llm, k=3, new_tokens=12)}
    figures = suite.figures({"engines": {"npqwen": out}})
    print(figures)
    assert set(figures) == {"spec_verify_2_vs_1", "spec_verify_3_vs_1", "spec_verify_4_vs_1",
                            "spec_100_vs_plain", "spec_80_vs_plain", "spec_60_vs_plain"}
    assert out["spec_100_kept_pct"] == 100 and out["spec_60_kept_pct"] < 100


def test_logprobs_with_drafts_equal_without():
    llm = npqwen.load("tiny")
    prompt = list(range(65, 75)) * 3
    answer = llm.generate(prompt, max_new_tokens=20, temperature=0).token_ids
    got = {}
    for spec in (None, {"method": "ngram", "k": 4}):
        engine = Engine(llm, kv_cache_tokens=1024, page_size=16)
        engine.propose = lambda req: continuation([prompt], [answer], 512, 0.2)(engine, req)
        engine.add_request(prompt, max_new_tokens=20, temperature=0, logprobs=2, speculative=spec)
        pairs = []
        while engine.has_unfinished():
            pairs += [(t, lp) for out in engine.step() for t, lp in zip(out.token_ids, out.logprobs or [])]
        got[spec is None] = pairs
        assert engine.stats["spec_decode_num_accepted_tokens"] > 0 or spec is None
    assert [t for t, _ in got[False]] == answer
    for (t, (lp, top)), (u, (lq, topq)) in zip(got[False], got[True]):
        assert t == u and abs(lp - lq) < 1e-4 and [i for i, _ in top] == [i for i, _ in topq]


def test_hooks_see_propose_verify_accept():
    """Engine(hooks=...) calls speculative.propose, .verify and .accept for each verification, in that order:
    the drafts (as step_log records them), the k + 1 rows the kept tokens were picked from, and which drafts
    were kept; a propose hook's drafts replace the engine's (greedy output unchanged, none kept); accept is
    read only; a name that is not one of them is one error that names the nearest."""
    llm = npqwen.load("tiny")
    prompt = list(range(65, 75)) * 3
    plain = llm.generate(prompt, max_new_tokens=20, temperature=0).token_ids

    def run(hooks):
        engine = Engine(llm, kv_cache_tokens=1024, page_size=16, record_steps=True, hooks=hooks)
        propose = continuation([prompt], [plain], llm.config.vocab_size, 0.3, seed=2)
        engine.propose = lambda req: propose(engine, req)
        engine.add_request(prompt, max_new_tokens=20, temperature=0, speculative={"method": "ngram", "k": 4})
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        return [t for o in outs for t in o.token_ids], [o for o in outs if o.drafts], engine

    seen = []
    tokens, verified, engine = run({name: lambda a, name: seen.append((name, a.copy())) for name in SPECULATIVE})
    assert tokens == plain
    rows = [r for step in engine.step_log for r in step if r.draft_tokens]
    assert [name for name, _ in seen] == list(SPECULATIVE) * len(rows) and len(rows) == len(verified) > 0
    for (_, drafts), (_, logits), (_, kept), row, out in zip(seen[::3], seen[1::3], seen[2::3], rows, verified):
        assert drafts.tolist() == list(row.drafts) == out.drafts and drafts.dtype == np.int64
        assert logits.shape == (1 + len(drafts), llm.config.vocab_size) and logits.dtype == np.float32
        assert kept.tolist() == [i < row.accepted_tokens for i in range(len(drafts))]
        assert out.token_ids == [int(np.argmax(r)) for r in logits[:len(out.token_ids)]]   # picked from these rows
    print(f"{len(rows)} verifications, {engine.stats['spec_decode_num_accepted_tokens']} drafts kept")
    assert 0 < engine.stats["spec_decode_num_accepted_tokens"] < engine.stats["spec_decode_num_draft_tokens"]

    wrong = lambda drafts, name: (drafts + 1) % llm.config.vocab_size   # every draft replaced by a wrong one
    tokens, verified, engine = run({"speculative.propose": wrong})
    assert tokens == plain and verified and engine.stats["spec_decode_num_accepted_tokens"] == 0
    def force_7(rows, name):   # a verify hook's rows are what the tokens are picked from
        rows = rows.copy()
        rows[:, 7] = 1e9
        return rows
    tokens, verified, engine = run({"speculative.verify": force_7})
    assert verified and all(t == 7 for o in verified for t in o.token_ids) and tokens != plain
    with pytest.raises(NpqwenError, match="read it, not replace it"):
        run({"speculative.accept": lambda kept, name: ~kept})
    with pytest.raises(NpqwenError, match=r"unknown hook name 'speculative.drafts'; did you mean speculative\."):
        Engine(llm, hooks={"speculative.drafts": print})


def test_tensor_parallelism_refuses_mtp_speculation():
    """Under tensor parallelism (here a communicator that says two ranks, rank 0 leading) a request that drafts
    with the MTP head is one clear error, before it runs; prompt lookup is taken (tests/test_parallel.py runs it on
    2 ranks against one process)."""
    llm = npqwen.load("tiny")
    engine = Engine(llm, kv_cache_tokens=256, page_size=16)

    class TwoRanks:   # what rank 0 leading a group of two looks like to the engine
        size, rank, leading = 2, 0, True
    llm.comm = TwoRanks()
    with pytest.raises(NpqwenError, match='"mtp" does not run under tensor parallelism yet .* use method "ngram"'):
        engine.add_request("abcabc", max_new_tokens=4, speculative={"method": "mtp", "k": 2})
    assert engine.add_request("abcabc", max_new_tokens=4, speculative={"method": "ngram", "k": 2}) in engine.requests
