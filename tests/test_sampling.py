"""Sampling: each filter equals the HF logits processor it mirrors; draws follow the filtered distribution."""
import json

import numpy as np
import pytest

from npqwen import NpqwenError
from npqwen import sampling as S

from tolerance import EPS32

try:
    import torch
    from transformers.generation import logits_process as lp
except ImportError:   # the comparisons with HF skip; the rest of the file needs neither
    torch = lp = None
needs_hf = pytest.mark.skipif(lp is None, reason="compares with transformers' logits processors (needs torch)")

V = 1000


def random_logits(seed, n=V, scale=3.0):
    return (scale * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def hf(processor, logits, input_ids=(0,)):
    out = processor(torch.tensor([list(input_ids)]), torch.tensor(logits)[None].clone())
    return out[0].numpy()


def same(ours, theirs):
    assert np.array_equal(np.isneginf(ours), np.isneginf(theirs)), "different tokens filtered out"
    finite = ~np.isneginf(theirs)
    # float32 logits through a few elementwise steps (scale, penalty, a softmax for top-p): each rounded once
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=8 * EPS32, atol=8 * EPS32)


@needs_hf
@pytest.mark.parametrize("seed", range(5))
def test_filters_equal_hf_processors(seed):
    x = random_logits(seed)
    seen = np.random.default_rng(seed).integers(0, V, size=60).tolist()
    for k in (1, 20, 50, 999):
        same(S.top_k(x, k), hf(lp.TopKLogitsWarper(top_k=k), x))
    for p in (0.05, 0.5, 0.9, 0.95, 0.999):
        same(S.top_p(x, p), hf(lp.TopPLogitsWarper(top_p=p), x))
    for p in (0.01, 0.1, 0.5, 0.9):
        same(S.min_p(x, p), hf(lp.MinPLogitsWarper(min_p=p), x))
    for t in (0.3, 0.6, 1.0, 1.7):
        same(S.temperature(x, t), hf(lp.TemperatureLogitsWarper(t), x))
    for r in (0.8, 1.1, 1.5):
        same(S.repetition_penalty(x, seen, r), hf(lp.RepetitionPenaltyLogitsProcessor(r), x, seen))


@needs_hf
def test_top_k_keeps_ties_like_hf():
    x = np.array([1, 3, 3, 3, 2, 0], dtype=np.float32)
    same(S.top_k(x, 2), hf(lp.TopKLogitsWarper(top_k=2), x))
    assert np.isfinite(S.top_k(x, 2)).sum() == 3


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    kept = np.isfinite(S.top_p(x, 0.7))
    assert kept.tolist() == [True, True, False, False]     # 0.5 < 0.7 <= 0.5 + 0.3
    assert np.isfinite(S.top_p(x, 0.5)).tolist() == [True, False, False, False]


def test_presence_penalty_once_per_generated_token():
    x = random_logits(9)
    out = S.presence_penalty(x, [3, 3, 3, 7], 1.5)
    expected = x.copy()
    expected[[3, 7]] -= 1.5
    np.testing.assert_array_equal(out, expected)


@needs_hf
def test_processor_chain_equals_hf_chain():
    """choose() narrows to the top-k survivors for speed; its distribution equals HF's full chain."""
    params = S.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2)
    x, seen = random_logits(11), list(range(0, 200, 3))
    chain = lp.LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(1.2), lp.TemperatureLogitsWarper(0.7),
                                    lp.TopKLogitsWarper(40), lp.TopPLogitsWarper(0.9), lp.MinPLogitsWarper(0.05)])
    want = torch.softmax(torch.tensor(hf(chain, x, seen), dtype=torch.float64), -1).numpy()
    rng, n = np.random.default_rng(0), 40_000
    counts = np.bincount([S.choose(x, params, rng, seen) for _ in range(n)], minlength=V)
    check_frequencies(counts, want, n)


@pytest.mark.parametrize("params", [S.SamplingParams(temperature=1.0),
                                    S.SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
                                    S.SamplingParams(temperature=1.3, top_p=0.8),
                                    S.SamplingParams(temperature=0.9, min_p=0.1)])
def test_sampled_frequencies_follow_the_filtered_distribution(params):
    x = random_logits(5, n=50, scale=1.5)
    f = S.temperature(x, params.temperature)
    f = S.min_p(S.top_p(S.top_k(f, params.top_k), params.top_p), params.min_p)
    want = S.softmax(f.astype(np.float64))
    rng, n = np.random.default_rng(1), 30_000
    counts = np.bincount([S.choose(x, params, rng) for _ in range(n)], minlength=50)
    check_frequencies(counts, want, n)


def check_frequencies(counts, want, n):
    """Stated bound: every token's frequency is within 5 standard errors of its probability
    (sqrt(p(1-p)/n), plus 1/n for p near 0); a filtered-out token is never drawn."""
    freq = counts / n
    bound = 5 * np.sqrt(want * (1 - want) / n) + 1 / n
    worst = np.argmax(np.abs(freq - want) / bound)
    print(f"{n} draws; worst token {worst}: frequency {freq[worst]:.4f} vs p {want[worst]:.4f} "
          f"(bound {bound[worst]:.4f})")
    assert counts[want == 0].sum() == 0
    assert np.all(np.abs(freq - want) <= bound)


def test_seed_reproduces_and_greedy_is_argmax():
    x = random_logits(3)
    params = S.SamplingParams(temperature=0.8, top_k=50)

    def draws(seed):
        rng = np.random.default_rng(seed)
        return [S.choose(x, params, rng) for _ in range(20)]

    assert draws(5) == draws(5) and len(set(draws(5))) > 1 and draws(5) != draws(6)
    assert S.choose(x, S.SamplingParams(temperature=0), np.random.default_rng(0)) == int(np.argmax(x))


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "finite"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(seed=-3), "seed must be a non-negative integer"),
])
def test_invalid_values(bad, message):
    with pytest.raises(NpqwenError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        S.SamplingParams(**bad)


def test_generation_config_defaults_and_overrides(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}))
    defaults = S.read_generation_config(tmp_path)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [151645, 151643]}
    assert S.sampling_params(defaults) == S.SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    assert S.sampling_params(defaults, temperature=0, top_k=5) == S.SamplingParams(temperature=0, top_k=5,
                                                                                  top_p=0.95)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))   # no do_sample: greedy
    assert S.sampling_params(S.read_generation_config(tmp_path)).greedy


def test_numpy_scalars_are_numbers_and_bools_are_not():
    p = S.SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float32(0.9),
                         min_p=np.float64(0.01), repetition_penalty=np.float32(1.1),
                         presence_penalty=np.int32(1), seed=np.int64(3))
    assert p == S.SamplingParams(temperature=0.5, top_k=3, top_p=float(np.float32(0.9)), min_p=0.01,
                                 repetition_penalty=float(np.float32(1.1)), presence_penalty=1.0, seed=3)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.seed) is int
    for bad in (dict(temperature=True), dict(top_k=True), dict(seed=False), dict(top_p=np.bool_(True)),
                dict(temperature="0.5"), dict(top_k=np.float32(3))):
        with pytest.raises(NpqwenError, match=next(iter(bad))):
            S.SamplingParams(**bad)


@pytest.mark.parametrize("seed", range(10))
def test_tiny_temperature_is_greedy(seed):
    """logits / 1e-38 overflowed to inf (every token tied, the last one drawn); now the top token gets p ~ 1."""
    x = random_logits(seed)
    for t in (1e-38, 1e-300, 5e-324):
        for params in (S.SamplingParams(temperature=t), S.SamplingParams(temperature=t, top_k=20, top_p=0.95)):
            assert S.choose(x, params, np.random.default_rng(seed)) == int(np.argmax(x))


@pytest.mark.parametrize("params", [S.SamplingParams(presence_penalty=1e300), S.SamplingParams(temperature=1.0,
                                    presence_penalty=1e300), S.SamplingParams(temperature=1e-30, presence_penalty=1e300),
                                    S.SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1e300)])
def test_huge_penalties_stay_finite_and_avoid_the_penalised_tokens(params):
    x = random_logits(4)
    top = np.argsort(x)[::-1][:10].tolist()       # penalise the 10 most likely tokens
    assert np.all(np.isfinite(S.presence_penalty(x, top, 1e300)))
    assert np.all(np.isfinite(S.repetition_penalty(x, top, 1e300)))
    assert np.all(np.isfinite(S.repetition_penalty(x, top, 1e-300)))   # a tiny one pushes them up, to float32's max
    rng = np.random.default_rng(0)
    with np.errstate(over="raise", invalid="raise"):   # no overflow or nan on the way
        picks = [S.choose(x, params, rng, prompt_ids=top[:5], generated_ids=top[5:] + top[:5]) for _ in range(50)]
    assert not set(picks) & set(top)


def test_generation_config_null_means_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": None, "top_k": None, "top_p": None, "min_p": None,
         "repetition_penalty": None, "eos_token_id": None}))
    assert S.read_generation_config(tmp_path) == {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@pytest.mark.parametrize("content, message", [
    ({"do_sample": True, "temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
    ({"do_sample": True, "top_p": 7}, "top_p must be in"),
    ({"repetition_penalty": [1.1]}, "repetition_penalty must be a finite number"),
    ({"eos_token_id": "258"}, "eos_token_id must be a token id or a list of token ids, got '258'"),
    ({"eos_token_id": [258, "x"]}, "eos_token_id"), ({"eos_token_id": []}, "eos_token_id"),
    ([{"temperature": 0.6}], "expected a JSON object"), ("hot", "expected a JSON object")])
def test_bad_generation_config_names_the_file_and_the_key(tmp_path, content, message):
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(NpqwenError) as e:
        S.read_generation_config(tmp_path)
    assert str(tmp_path / "generation_config.json") in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)
