"""The forward pass with and without a recorder: the same calls, bit-identical results; a recorder
changes what is kept, never which code runs. And forward_batch returns its outputs (BatchOutput)."""
import copy
import dataclasses

import numpy as np
import pytest

import npqwen
from npqwen import ops
from npqwen.kv_cache import Batch
from npqwen.model import BatchOutput
from npqwen.trace import Trace

from tolerance import rounding_tolerance


def mixed_batch(last_decodes: bool) -> Batch:
    """Three sequences over pages of 8: two decode one token (at 9 and 12 cached positions), one reads a
    4-token chunk after 3 cached positions; the decoding one at 12 comes last or not. Rows 1 and 3 of the
    chunk give hidden states, its last row is scored on tokens 7 and 9."""
    seqs = [(9, 1, [0, 1]), (3, 4, [2]), (12, 1, [3, 4])]   # (start, new tokens, page table)
    if not last_decodes:
        seqs = [seqs[0], seqs[2], seqs[1]]
    ends = np.cumsum([n for _, n, _ in seqs])
    chunk = next(i for i, (_, n, _) in enumerate(seqs) if n == 4)
    first = ends[chunk] - 4
    return Batch(np.array([5, 6, 7, 8, 9, 10]), [s for s, _, _ in seqs], [n for _, n, _ in seqs],
                 [np.array(t) for _, _, t in seqs], 8,
                 sample_rows=np.array([e - 1 for e, (_, n, _) in zip(ends, seqs) if n == 1]),
                 hidden_rows=np.array([first + 1, first + 3]), score_rows=np.array([first + 3]),
                 score_ids=np.array([[7, 9]]))


def filled_cache(model):
    kv = model.new_kv_cache(16, 8)
    rng = np.random.default_rng(0)
    kv.keys[...] = rng.standard_normal(kv.keys.shape)
    kv.values[...] = rng.standard_normal(kv.values.shape)
    return kv


def spy_on_attention(monkeypatch) -> list:
    """Every call of the two attention operators, as (name, shapes, position arguments)."""
    calls = []
    paged, decode = ops.paged_attention, ops.paged_decode_attention

    def paged_attention(q, keys, values, table, start, **kw):
        calls.append(("paged_attention", q.shape, list(table), start))
        return paged(q, keys, values, table, start, **kw)

    def paged_decode_attention(q, keys, values, tables, lengths, *args):
        calls.append(("paged_decode_attention", q.shape, [list(t) for t in tables], list(lengths)))
        return decode(q, keys, values, tables, lengths, *args)

    monkeypatch.setattr(ops, "paged_attention", paged_attention)
    monkeypatch.setattr(ops, "paged_decode_attention", paged_decode_attention)
    return calls


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("last_decodes", [True, False])
def test_a_recorder_runs_the_same_attention_and_changes_no_bit(name, last_decodes, monkeypatch):
    model = npqwen.load(name).model
    calls = spy_on_attention(monkeypatch)
    kv, kv_traced = filled_cache(model), filled_cache(model)
    plain = model.forward_batch(mixed_batch(last_decodes), kv)
    plain_calls = calls[:]
    calls.clear()
    trace = Trace()
    traced = model.forward_batch(mixed_batch(last_decodes), kv_traced, trace)
    assert calls == plain_calls and len(calls) == 2 * model.config.num_hidden_layers   # one chunk, one decode call
    for got, want in zip(traced, plain):
        assert np.array_equal(got, want)
    assert np.array_equal(kv_traced.keys, kv.keys) and np.array_equal(kv_traced.values, kv.values)
    assert np.array_equal(trace["lm_head"], plain.logits)


@pytest.mark.parametrize("last_decodes", [True, False])
def test_recorded_attention_probabilities_are_the_last_sequence_s(last_decodes):
    model = npqwen.load("tiny").model
    batch, kv = mixed_batch(last_decodes), filled_cache(model)
    trace = Trace()
    model.forward_batch(batch, kv, trace)
    (row, n), start, table = batch.rows[-1], batch.starts[-1], batch.page_tables[-1]
    q = trace["model.layers.1.self_attn.q_rope"][row:row + n]                        # (n, H, Dh)
    _, want = ops.paged_attention(q, kv.keys[1], kv.values[1], table, start, want_probs=True)   # (H, n, S)
    got = trace["model.layers.1.self_attn.attn_probs"]
    assert got.shape == want.shape == (4, n, start + n)
    bound = rounding_tolerance(start + n, 2)   # q.k over Dh = 8 < S keys, then a softmax over S: float32
    assert np.allclose(got, want, rtol=0, atol=bound) and np.allclose(got.sum(axis=-1), 1, rtol=0, atol=bound)


def test_one_sequence_forward_is_bit_identical_with_a_recorder():
    """Prefill, then a decoded token from the cache (the single-sequence path, batched decode included)."""
    llm = npqwen.load("tiny")
    ids = llm.tokenizer.encode("Hello there, how are you?")
    results = []
    for recorder in (None, Trace()):
        cache = llm.model.new_cache(64)
        results.append((llm.forward(ids, cache, recorder=recorder), llm.forward([42], cache, recorder=recorder),
                        cache.kv.keys.copy()))
    for got, want in zip(*results):
        assert np.array_equal(got, want)


def test_forward_batch_returns_its_outputs_and_leaves_the_batch_alone():
    model = npqwen.load("tiny").model
    batch = mixed_batch(True)
    fields = [f.name for f in dataclasses.fields(batch)]
    before = copy.deepcopy({name: getattr(batch, name) for name in fields})
    out = model.forward_batch(batch, filled_cache(model))
    assert isinstance(out, BatchOutput)
    assert out.logits.shape == (2, model.config.vocab_size) and out.hidden.shape == (2, model.config.hidden_size)
    assert out.scores.shape == (1, 2)
    assert not hasattr(batch, "hidden") and not hasattr(batch, "scores")
    for name in fields:
        value = getattr(batch, name)
        same = (all(np.array_equal(a, b) for a, b in zip(value, before[name])) if isinstance(value, list)
                else np.array_equal(value, before[name]))
        assert same, name
