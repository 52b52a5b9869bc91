"""The engine's opt-in record of its steps (Engine(record_steps=True), npqwen/engine/step_log.py) says what
the requests did: each request's prompt tokens add up to its prompt minus its prefix hit, a decoding
request computes one token per step, a row starts where the request's cache stood before the step, and
recording changes no token."""
import numpy as np

import npqwen
from npqwen import Engine


def run(engine, requests, late=()):
    """Add (prompt, kwargs) requests, then `late` ones at the step each names; step to the end, checking each
    step's rows (if recorded) against every request's cached_len before and after it. {request id: output tokens}."""
    ids = [engine.add_request(p, **kw) for p, kw in requests]
    tokens, step = {}, 0
    while engine.has_unfinished() or any(at >= step for at, _, _ in late):
        ids += [engine.add_request(p, **kw) for at, p, kw in late if at == step]
        before = {rid: req.cached_len for rid, req in engine.requests.items()}
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        engine.check()
        for row in engine.step_log[step] if engine.step_log is not None else []:
            req = engine.requests.get(row.request_id)
            # it starts where its cache stood, or, admitted now, at its prefix hit (whole pages)
            assert row.start == before[row.request_id] or (before[row.request_id] == 0
                                                           and row.start % engine.page_size == 0), (step, row)
            assert req is None or req.cached_len in (row.start + row.tokens, 0), (step, row)   # 0: preempted
        step += 1
    if engine.step_log is not None:
        assert len(engine.step_log) == step
    return {rid: tokens[rid] for rid in ids}


def test_the_record_says_what_the_requests_did():
    llm = npqwen.load("tiny", dtype="float64")
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 13).tolist()
    first, second = shared + rng.integers(0, 256, 30).tolist(), shared + rng.integers(0, 256, 5).tolist()
    short = rng.integers(0, 256, 3).tolist()
    kw = {"max_new_tokens": 6, "temperature": 0}
    engine = Engine(llm, kv_cache_tokens=256, page_size=4, max_batched_tokens=16, record_steps=True)
    tokens = run(engine, [(first, kw), (short, kw)], late=[(4, second, kw)])
    log = engine.step_log
    prompt_ids = {rid: p for rid, p in zip(tokens, [first, short, second])}
    hit = {rid: 0 for rid in tokens}
    hit[list(tokens)[2]] = 12                       # the shared 13 tokens: three full pages of 4
    assert engine.stats["prefix_cache_hit_tokens"] == 12
    for rid, out in tokens.items():
        rows = [row for step in log for row in step if row.request_id == rid]
        prompt, decode = sum(r.prompt_tokens for r in rows), [r.decode_tokens for r in rows if r.decode_tokens]
        print(f"{rid}: prompt {len(prompt_ids[rid])}, hit {hit[rid]}, prompt tokens in the record {prompt}, "
              f"decode rows {len(decode)}, tokens out {len(out)}")
        assert prompt == len(prompt_ids[rid]) - hit[rid]
        assert decode == [1] * (len(out) - 1)       # the last sampled token is never computed
    for i, step in enumerate(log):
        assert sum(r.tokens for r in step) <= 16
        assert len({r.request_id for r in step}) == len(step)
    second_rows = [row for step in log for row in step if row.request_id == list(tokens)[2]]
    assert second_rows[0].start == 12                # admitted with its hit cached
    off = Engine(llm, kv_cache_tokens=256, page_size=4, max_batched_tokens=16)
    assert off.step_log is None
    assert list(run(off, [(first, kw), (short, kw)], late=[(4, second, kw)]).values()) == list(tokens.values())


def test_a_preempted_request_recomputes_what_it_generated():
    llm = npqwen.load("tiny", dtype="float64")
    prompts = [list(range(10, 16)), list(range(20, 26))]
    engine = Engine(llm, kv_cache_tokens=24, page_size=4, max_batched_tokens=16, record_steps=True)
    tokens = run(engine, [(p, {"max_new_tokens": 10, "temperature": 0}) for p in prompts])
    assert engine.stats["preemptions"] == 1
    _, b = tokens
    rows = [row for step in engine.step_log for row in step if row.request_id == b]
    print("b's rows:", rows)
    back = next(i for i in range(1, len(rows)) if rows[i].start < rows[i - 1].start + rows[i - 1].tokens)
    # b comes back after a preemption: the rest of its prompt and the tokens it had generated, recomputed in one
    # chunk (those generated ones count as decode tokens), then one token per step again
    T, again = len(prompts[1]), rows[back]
    generated = back                                 # the tokens it had sampled: one per row before it
    assert again.start + again.tokens == T + generated          # everything it knew, computed again
    assert again.decode_tokens == T + generated - max(again.start, T) > 1
    assert sum(r.prompt_tokens for r in rows) == T + max(T - again.start, 0)
    assert [r.decode_tokens for r in rows[back + 1:]] == [1] * (len(tokens[b]) - generated - 1)
