"""Attribution with gradients (npqwen/attribution.py): gradient x input, integrated gradients (completeness),
attribution patching against real activation patching (their correlation printed and bounded)."""
import numpy as np
import pytest

import npqwen
from npqwen import attribution, grad

CLEAN, CORRUPT = "The capital of France is Paris", "The capital of Greece is Paris"   # as many bytes (tokens)
TARGET = grad.log_prob(ord("!"))


@pytest.fixture(scope="module")
def tiny():
    return npqwen.load("tiny", dtype="float64")


def test_gradient_x_input_per_token_and_layer(tiny):
    s = attribution.gradient_x_input(tiny, CLEAN, TARGET)
    T, L = len(CLEAN), tiny.config.num_hidden_layers
    assert s.per_layer.shape == (L + 1, T) and np.array_equal(s.per_token, s.per_layer[0])
    g = grad.gradients(tiny, CLEAN, TARGET, weights=False)
    x, d = g.tape["model.layers.0"], g["model.layers.0"]
    assert np.allclose(s.per_layer[1], (x * d).sum(-1))
    # the last layer's output reaches the last position's logits only through that position
    assert np.all(s.per_layer[-1][:-1] == 0) and s.per_layer[-1][-1] != 0
    lines = s.text([chr(t) for t in tiny.prompt_ids(CLEAN)]).splitlines()
    print("\n".join(lines))
    assert len(lines) == T and "#" * 20 in s.text([chr(t) for t in tiny.prompt_ids(CLEAN)])


@pytest.mark.parametrize("baseline", [None, "zeros"])
def test_integrated_gradients_add_up_to_the_change(tiny, baseline):
    """Completeness: the shares sum to f(x) - f(x0). From <|endoftext|>'s embedding (the default) the midpoint
    rule is exact to 0.1% at 64 steps; from zeros it is not: the first RMSNorm jumps near 0 (the gap says so)."""
    ig = attribution.integrated_gradients(tiny, CLEAN, TARGET, steps=64,
                                          baseline=None if baseline is None else np.zeros((len(CLEAN), 16)))
    change = ig.value - ig.baseline_value
    print(f"baseline {baseline}: sum of shares {ig.per_token.sum():.5f}, f(x) - f(x0) {change:.5f}, gap {ig.gap:.2e}")
    assert ig.per_token.shape == (len(CLEAN),)
    if baseline is None:
        assert abs(ig.gap) < 1e-3 * abs(change)
    else:
        assert abs(ig.gap) > 0.1 * abs(change)


@pytest.mark.parametrize("name, at_least", [("tiny", 0.95), ("tiny-moe", 0.8), ("tiny-qwen3.5", 0.7)])
def test_attribution_patching_follows_activation_patching(name, at_least):
    llm = npqwen.load(name, dtype="float64")
    estimate = attribution.attribution_patching(llm, CLEAN, CORRUPT, TARGET)
    real = attribution.activation_patching(llm, CLEAN, CORRUPT, TARGET)
    assert estimate.effect.shape == real.effect.shape == (llm.config.num_hidden_layers + 1, len(CLEAN))
    assert estimate.clean_value == pytest.approx(real.clean_value) and \
        estimate.corrupt_value == pytest.approx(real.corrupt_value)
    r = np.corrcoef(estimate.effect.ravel(), real.effect.ravel())[0, 1]
    print(f"{name}: correlation of attribution patching with activation patching over "
          f"{real.effect.size} (layer, position) cells: {r:.3f}")
    assert r > at_least
    # patching the last layer's output everywhere but at the last position changes nothing, in both
    assert np.all(real.effect[-1, :-1] == 0) and np.all(estimate.effect[-1, :-1] == 0)


def test_bad_input_is_named(tiny):
    with pytest.raises(npqwen.NpqwenError, match="as many tokens.*30 and 29"):
        attribution.attribution_patching(tiny, CLEAN, CLEAN[:-1], TARGET)
    with pytest.raises(npqwen.NpqwenError, match="steps must be a positive integer"):
        attribution.integrated_gradients(tiny, CLEAN, TARGET, steps=0)
    with pytest.raises(npqwen.NpqwenError, match=r"the baseline must have the embedding's shape \(30, 16\)"):
        attribution.integrated_gradients(tiny, CLEAN, TARGET, baseline=np.zeros((3, 16)))
