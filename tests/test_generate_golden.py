"""Greedy generation equals HF generate(do_sample=False); KV-cache decoding equals full recomputation."""
import numpy as np
import pytest

import npqwen
from npqwen.backend import to_numpy
from npqwen.generate import decode_one_token, prefill

from conftest import DEVICES, build_hf_checkpoint, hf_model, tiny_config
from tolerance import relative_diff, tolerance_of

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW_TOKENS = 32


def hf_greedy(ref, prompt, n):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_greedy(llm, ref, prompt, n=NEW_TOKENS):
    ours = llm.generate(prompt, max_new_tokens=n, temperature=0).token_ids
    want = hf_greedy(ref, prompt, n)
    first = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
    print(f"prompt {len(prompt)} tokens: {len(ours)} generated, first mismatching token: {first}"
          + (f" (npqwen {ours[first]}, HF {want[first]})" if first is not None else ""))
    assert len(ours) == len(want) >= min(n, 1) and first is None


def check_cache_equals_recompute(llm, prompt, n=20, chunk=512):
    """Logits of each decode step (KV cache) vs one full forward over the whole sequence."""
    cache = llm.new_cache(len(prompt) + n)
    step_logits = [to_numpy(prefill(llm.model, prompt, cache, chunk=chunk))]
    tokens = []
    for _ in range(n - 1):
        tokens.append(int(step_logits[-1].argmax()))
        step_logits.append(to_numpy(decode_one_token(llm.model, tokens[-1], cache)))
    full = to_numpy(llm.forward(prompt + tokens))[len(prompt) - 1:]
    err, bound = relative_diff(np.stack(step_logits), full), tolerance_of(llm, len(prompt) + n)
    print(f"KV-cache decode vs full recompute: relative max |logit diff| {err:.2e} over {n} positions (chunk {chunk}; "
          f"tolerance {bound:.1e})")
    assert err <= bound   # one token's row of the sums against the whole sequence's: blocked otherwise


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_hf_checkpoint(tmp_path_factory.mktemp("gen_tiny"), tiny_config(max_position_embeddings=1024),
                               std=0.1)
    return path, hf_model(path)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("length", [1, 5, 37, 600])   # 600 crosses a prefill chunk boundary (512)
def test_greedy_equals_hf_tiny(tiny, length, device):
    path, ref = tiny
    llm = npqwen.load(path, device=device)
    prompt = np.random.default_rng(length).integers(0, 512, size=length).tolist()
    check_greedy(llm, ref, prompt)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_hf_qwen3_0_6b_shape(qwen3_0_6b_shape, device):
    llm = npqwen.load(qwen3_0_6b_shape, device=device)
    ref = hf_model(qwen3_0_6b_shape)
    rng = np.random.default_rng(7)
    for length in (9, 130):
        check_greedy(llm, ref, rng.integers(0, 151643, size=length).tolist())
    check_cache_equals_recompute(llm, rng.integers(0, 151643, size=12).tolist(), n=16)


@pytest.mark.parametrize("chunk", [512, 7, 1])
def test_kv_cache_decode_equals_full_recompute(tiny, chunk):
    llm = npqwen.load(tiny[0])
    check_cache_equals_recompute(llm, np.random.default_rng(3).integers(0, 512, size=40).tolist(), chunk=chunk)
