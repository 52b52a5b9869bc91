"""run_with_cache and run_with_hooks: the names, a cache that changes nothing, hooks that replace a value
(checked), and each edit equal to HF doing the same with torch forward hooks (Qwen3-0.6B shape, Qwen3-MoE)."""
import numpy as np
import pytest

import npqwen
from npqwen.hooks import step_names

from conftest import build_hf_checkpoint, hf_model, tiny_moe_config
from tolerance import logprob_tolerance, model_tolerance, relative_diff

IDS = [5, 17, 33, 2, 101, 7, 64, 250]


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def tiny(request):
    return npqwen.load(request.param)


def test_the_cache_holds_every_name_and_changes_no_logit(tiny):
    logits, cache = tiny.run_with_cache(IDS)
    assert np.array_equal(logits, tiny.forward(IDS))
    assert list(cache.keys()) == step_names(tiny.config)
    assert cache["model.layers.1.self_attn.attn_output"].shape == (len(IDS), tiny.config.num_attention_heads *
                                                                   tiny.config.head_dim)
    assert np.array_equal(cache["lm_head"], logits)


def test_names_keep_only_those(tiny):
    _, cache = tiny.run_with_cache(IDS, names=["model.layers.0"])
    assert list(cache) == ["model.layers.0"]
    _, cache = tiny.run_with_cache(IDS, names=lambda n: n.endswith("o_proj"))
    assert list(cache) == [f"model.layers.{i}.self_attn.o_proj" for i in range(tiny.config.num_hidden_layers)]


def test_hooks_that_return_their_input_change_no_bit(tiny):
    names = step_names(tiny.config)
    hooks = {n: (lambda a, name: a) for n in names} | {"lm_head": lambda a, name: None}
    assert np.array_equal(tiny.run_with_hooks(IDS, hooks), tiny.forward(IDS))


def test_a_returned_array_replaces_the_value_from_then_on(tiny):
    name = "model.layers.0"
    _, clean = tiny.run_with_cache(IDS)
    logits, hooked = tiny.run_with_cache(IDS, hooks={name: lambda a, n: a * 2})
    assert np.array_equal(hooked[name], clean[name] * 2)
    assert not np.allclose(logits, clean["lm_head"])
    assert np.array_equal(hooked["model.layers.0.self_attn.o_proj"], clean["model.layers.0.self_attn.o_proj"])


@pytest.mark.parametrize("name, fn, says", [
    ("model.layers.1.mlp.down_prj", lambda a, n: a, "unknown hook name 'model.layers.1.mlp.down_prj'; did you mean "
                                                    "model.layers.1.mlp."),
    ("model.layers.1.self_attn.o_proj", lambda a, n: a[:2], "returned shape (2, 16) dtype float32; it must keep shape (8, 16)"),
    ("model.layers.1.self_attn.o_proj", lambda a, n: a.astype(np.float64), "dtype float64; it must keep"),
    ("model.layers.1.self_attn.o_proj", lambda a, n: a.tolist(), "returned list; return a ndarray"),
    ("model.layers.1.self_attn.o_proj", lambda a, n: 1 / 0, "on model.layers.1.self_attn.o_proj raised "
                                                            "ZeroDivisionError"),
    ("model.layers.1.self_attn.attn_probs", lambda a, n: a * 0, "a hook may read it, not replace it"),
    ("model.layers.1", 3, "not a function"),
])
def test_bad_hooks_are_named(name, fn, says):
    llm = npqwen.load("tiny")
    with pytest.raises(npqwen.NpqwenError) as e:
        llm.run_with_hooks(IDS, {name: fn})
    print(e.value)
    assert says in str(e.value)
    with pytest.raises(npqwen.NpqwenError, match="unknown cache name 'lm_heads'; did you mean lm_head"):
        llm.run_with_cache(IDS, names=["lm_heads"])


# -- the same edits as HF with torch forward hooks --

def hf_edits(model, L: int, head: int, neuron: int, vector, clean_block):
    """The four edits as torch hooks on the HF modules: (module, kind, fn) per edit."""
    layer = model.model.layers[L]
    Dh = model.config.head_dim

    def zero_head(module, args):
        x = args[0].clone()
        x[..., head * Dh:(head + 1) * Dh] = 0
        return (x,)

    def zero_neuron(module, args, out):
        out = out.clone()
        out[..., neuron] = 0
        return out

    def add(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h + vector
        return (h, *out[1:]) if isinstance(out, tuple) else h

    def patch(module, args, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[:, 4] = clean_block
        return (h, *out[1:]) if isinstance(out, tuple) else h
    return {"head": (layer.self_attn.o_proj, "pre", zero_head), "neuron": (layer.mlp.act_fn, "post", zero_neuron),
            "steer": (layer, "post", add), "patch": (layer, "post", patch)}


def np_edits(llm, L: int, head: int, neuron: int, vector, clean_block):
    """The same four edits as npqwen hooks."""
    H, p = llm.config.num_attention_heads, f"model.layers.{L}"

    def zero_head(out, name):
        out = out.reshape(len(out), H, -1).copy()   # (T, H, Dh)
        out[:, head] = 0
        return out.reshape(len(out), -1)

    def zero_neuron(act, name):
        act = act.copy()
        act[:, neuron] = 0
        return act

    def patch(x, name):
        x = x.copy()
        x[4] = clean_block
        return x
    return {"head": (f"{p}.self_attn.attn_output", zero_head), "neuron": (f"{p}.mlp.act_fn", zero_neuron),
            "steer": (p, lambda x, name: x + vector.astype(x.dtype)), "patch": (p, patch)}


def compare_edits(llm, model, L, corrupt, clean, label):
    import torch

    _, clean_cache = llm.run_with_cache(clean, names=[f"model.layers.{L}"])
    clean_block = clean_cache[f"model.layers.{L}"][4]
    rng = np.random.default_rng(0)
    vector = (rng.standard_normal(llm.config.hidden_size) * 2).astype(np.float32)
    torch_edits = hf_edits(model, L, 1, 5, torch.from_numpy(vector), torch.from_numpy(clean_block))
    worst = 0.0
    for kind, (name, fn) in np_edits(llm, L, 1, 5, vector, clean_block).items():
        module, when, hook = torch_edits[kind]
        handle = module.register_forward_pre_hook(hook) if when == "pre" else module.register_forward_hook(hook)
        try:
            with torch.no_grad():
                want = model(torch.tensor([corrupt])).logits[0].numpy()
        finally:
            handle.remove()
        got = llm.run_with_hooks(corrupt, {name: fn})
        rel, tolerance = relative_diff(got, want), model_tolerance(llm.config, len(corrupt))
        changed = relative_diff(got, llm.forward(corrupt))
        print(f"{label} {kind:>6} on {name}: max |npqwen - HF| / max |HF| = {rel:.2e} (tolerance {tolerance:.1e}; "
              f"the edit moved logits by {changed:.3g})")
        # hooked and plain npqwen run the same sums in the same order: without the edit they are equal bit for bit
        assert changed > 1e-3, f"{kind}: the edit changed nothing"
        assert (got.argmax(-1) == want.argmax(-1)).all()
        worst = max(worst, rel)
    assert worst <= tolerance


@pytest.fixture(scope="module")
def shape_0_6b(qwen3_0_6b_shape):
    return npqwen.load(qwen3_0_6b_shape), hf_model(qwen3_0_6b_shape)


def test_edits_equal_hf_at_the_qwen3_0_6b_shape(shape_0_6b):
    llm, model = shape_0_6b
    compare_edits(llm, model, 9, [9, 791, 6722, 315, 9625, 374, 12366, 13],
                  [9, 791, 6722, 315, 15344, 374, 12366, 13], "Qwen3-0.6B shape")


def test_edits_equal_hf_on_qwen3_moe(tmp_path_factory):
    path = build_hf_checkpoint(tmp_path_factory.mktemp("moe-hooks"), tiny_moe_config(mlp_only_layers=[1]),
                               save_dtype="float32")
    llm, model = npqwen.load(path), hf_model(path)
    compare_edits(llm, model, 1, [3, 7, 11, 40, 2, 90, 13], [3, 7, 11, 40, 5, 90, 13], "Qwen3-MoE (layer 1 dense)")
    # on a sparse layer, the experts' output is the MLP's: steer and patch there
    compare_edits_sparse(llm, model)


def compare_edits_sparse(llm, model):
    import torch

    rng = np.random.default_rng(1)
    vector = rng.standard_normal(llm.config.hidden_size).astype(np.float32)
    ids = [3, 7, 11, 40, 2, 90, 13]

    def add(module, args, out):
        return (out[0] + torch.from_numpy(vector), *out[1:]) if isinstance(out, tuple) else out + torch.from_numpy(vector)
    handle = model.model.layers[0].mlp.register_forward_hook(add)
    try:
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
    finally:
        handle.remove()
    got = llm.run_with_hooks(ids, {"model.layers.0.mlp.experts": lambda x, n: x + vector})
    rel, tolerance = relative_diff(got, want), model_tolerance(llm.config, len(ids))
    print(f"Qwen3-MoE sparse layer 0: adding to mlp.experts, max |npqwen - HF| / max |HF| = {rel:.2e} "
          f"(tolerance {tolerance:.1e})")
    assert rel <= tolerance and (got.argmax(-1) == want.argmax(-1)).all()


def test_the_logit_lens_equals_hf_block_outputs_through_norm_and_lm_head(shape_0_6b):
    import torch

    llm, model = shape_0_6b
    ids = [9, 791, 6722, 315, 9625, 374, 12366, 13]
    lens = llm.logit_lens(ids, top_k=5)
    outputs = []
    handles = [layer.register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            final_logits = model(torch.tensor([ids])).logits[0].double()
            final = final_logits.softmax(-1).numpy()
            want = torch.stack([model.lm_head(model.model.norm(h))[0] for h in outputs]).double().softmax(-1).numpy()
    finally:
        for h in handles:
            h.remove()
    L, T = len(outputs), len(ids)
    got_top = np.take_along_axis(want, lens.top_ids, -1)                        # HF's probabilities of npqwen's top-k
    worst = float(np.abs(lens.top_probs - got_top).max())
    nxt = float(np.abs(lens.next_probs - want[:, np.arange(T - 1), ids[1:]]).max())
    print(f"logit lens, {L} layers x {T} positions: max |npqwen - HF| of the top-5 probabilities {worst:.2e}, "
          f"of the next token's {nxt:.2e}; the last layer against HF's own output {np.abs(want[-1] - final).max():.2e}")
    assert lens.top_ids.shape == (L, T, 5) and lens.next_ranks.shape == (L, T - 1)
    # probabilities (at most 1) from logits within the float32 bar: a softmax moves by at most its logits' error
    # (each layer's lens crosses up to all layers, a norm and the lm_head)
    tolerance = logprob_tolerance(llm.config, T, final_logits.numpy())
    assert worst <= tolerance and nxt <= tolerance
    assert np.array_equal(lens.top_ids[-1, :, 0], final.argmax(-1))
