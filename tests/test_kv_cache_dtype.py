"""--kv-cache-dtype (npqwen/kv_cache.py): bfloat16 and float8 e4m3 keys/values round exactly as torch's casts do,
int8 rows as their definition says; an engine on each compact dtype gives logits close to float32 keys/values
and holds the pool in a half or a quarter of the bytes; the default pool sets a step's scratch aside; attention's
score block shrinks for a long context and gives the same output."""
import numpy as np
import pytest

import npqwen
from npqwen import Engine, NpqwenError, ops
from npqwen.engine import engine as engine_module
from npqwen.kv_cache import KVCache, encode_kv, widen_kv

torch = pytest.importorskip("torch")

ROWS = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32) * np.float32(3)


def test_bfloat16_and_float8_round_as_torch_casts():
    for kv_dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float8_e4m3", torch.float8_e4m3fn)):
        codes, scale = encode_kv(ROWS, kv_dtype)
        ours = widen_kv(codes, scale, kv_dtype, np.float32)
        theirs = torch.from_numpy(ROWS).to(torch_dtype).float().numpy()
        wrong = np.flatnonzero(ours != theirs)
        assert codes.itemsize == {"bfloat16": 2, "float8_e4m3": 1}[kv_dtype]
        assert wrong.size == 0, f"{kv_dtype}: {wrong.size} values differ from torch's, first at {wrong[0]}: " \
                                f"{ours.flat[wrong[0]]} vs {theirs.flat[wrong[0]]} (of {ROWS.flat[wrong[0]]})"
    big = np.array([[500.0, -1e6, 448.0, 1e-4]], np.float32)   # past e4m3's 448: saturated (vLLM clamps the same)
    assert widen_kv(encode_kv(big, "float8_e4m3")[0], None, "float8_e4m3", np.float32).tolist() == \
        [[448.0, -448.0, 448.0, torch.tensor(1e-4).to(torch.float8_e4m3fn).item()]]


def test_int8_rows_carry_their_own_scale():
    codes, scale = encode_kv(ROWS, "int8")
    assert codes.dtype == np.int8 and scale.shape == (64,)
    np.testing.assert_array_equal(scale, np.abs(ROWS).max(-1) / 127)
    back = widen_kv(codes, scale, "int8", np.float32)
    assert np.abs(back - ROWS).max(-1).max() <= (scale / 2 * 1.0001).max()   # at most half a step of its own row
    zero, z_scale = encode_kv(np.zeros((1, 8), np.float32), "int8")           # an all-zero row: no division by 0
    assert not zero.any() and widen_kv(zero, z_scale, "int8", np.float32).tolist() == [[0.0] * 8]


@pytest.fixture(scope="module")
def llm():
    return npqwen.load("tiny")


def logits_of(llm, kv_dtype, ids):
    """Every position's logits from an engine-shaped pass whose attention reads keys/values as stored."""
    from npqwen.kv_cache import Batch
    kv = KVCache(llm.config, 4, 128, np, np.float32, kv_dtype=kv_dtype)
    batch = Batch(np.array(ids), [0], [len(ids)], [np.arange(4)], 128, sample_rows=np.arange(len(ids)))
    return llm.model.forward_batch(batch, kv).logits, kv


# the tiny model's bounds (measured over 300 tokens: 3.0e-2, 3.0e-2, 1.7e-1); docs/engine.md has the 0.6B shape's figures
@pytest.mark.parametrize("kv_dtype, bound, size", [("bfloat16", 5e-2, 1 / 2), ("int8", 5e-2, (8 + 4) / 32),
                                                   ("float8_e4m3", 3e-1, 1 / 4)])   # tiny: head_dim 8
def test_compact_keys_and_values_stay_close_to_float32(llm, kv_dtype, bound, size):
    ids = np.random.default_rng(1).integers(0, llm.config.vocab_size, 300).tolist()
    ref, kv_ref = logits_of(llm, "auto", ids)
    out, kv = logits_of(llm, kv_dtype, ids)
    rel = (np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max()
    top1 = (out.argmax(-1) == ref.argmax(-1)).mean()
    print(f"{kv_dtype}: logits max rel diff {rel:.2e}, top-1 agreement {top1:.1%}, bytes {kv.nbytes / kv_ref.nbytes}")
    assert 0 < rel < bound and top1 >= 0.9
    assert kv.nbytes == kv_ref.nbytes * size


def test_an_engine_on_compact_pages_generates(llm):
    """Chunked prefill, a prefix hit and batched decoding over compact pages, with the bookkeeping checked."""
    prompt = np.random.default_rng(2).integers(0, llm.config.vocab_size, 300).tolist()
    runs = {}
    for kv_dtype in ("auto", "bfloat16", "int8"):
        engine = Engine(llm, kv_cache_tokens=2048, page_size=64, max_batched_tokens=128, kv_cache_dtype=kv_dtype)
        ids = [engine.add_request(prompt + extra, max_new_tokens=8, temperature=0) for extra in ([], [7])]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
            engine.check()
        assert engine.cache.hit_tokens > 0, "the second prompt did not share the first one's pages"
        runs[kv_dtype] = list(tokens.values())
    assert runs["bfloat16"] == runs["auto"] and runs["int8"] == runs["auto"], runs


def test_the_default_pool_sets_the_step_scratch_aside(llm, monkeypatch):
    scratch = engine_module.step_scratch_bytes(llm.config, 512, 64)
    free = scratch + 2**21          # 1 MB for the pool: 16 pages of float32, 32 of bfloat16
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda xp: free)
    for kv_dtype in ("auto", "bfloat16", "int8"):
        engine = Engine(llm, kv_cache_dtype=kv_dtype)
        per_token = KVCache.bytes_per_token(llm.config, np.float32, kv_dtype)
        want = int((free - scratch) * engine_module.KV_MEMORY_SHARE) // per_token // engine.page_size
        assert engine.pool.num_pages == want, (kv_dtype, engine.pool.num_pages, want)
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda xp: scratch)   # nothing left for the pool
    with pytest.raises(NpqwenError, match="no room for a KV pool of even one page"):
        Engine(llm)
    engine = Engine(llm, kv_cache_tokens=512, page_size=256, kv_cache_dtype="int8")
    with pytest.raises(NpqwenError, match="needs 3 KV pages of 256 positions"):
        engine.add_request([i % 200 for i in range(600)], max_new_tokens=1)


def test_a_long_context_takes_smaller_score_blocks(monkeypatch):
    rng = np.random.default_rng(3)
    T, H, K, Dh, P = 300, 4, 2, 16, 64
    q, k, v = (rng.standard_normal((T, n, Dh)).astype(np.float32) for n in (H, K, K))
    pages = -(-T // P)
    keys, values = (np.zeros((pages, K, P, Dh), np.float32) for _ in range(2))
    for x, store in ((k, keys), (v, values)):
        store.reshape(-1, Dh)[((np.arange(T)[:, None] // P * K + np.arange(K)) * P + np.arange(T)[:, None] % P)
                              .reshape(-1)] = x.reshape(-1, Dh)
    want, _ = ops.causal_attention(q, k, v)
    monkeypatch.setattr(ops, "SCORES_BYTES", H * T * 4 * 7)   # blocks of 7 queries
    got, _ = ops.paged_attention(q, keys, values, np.arange(pages), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
