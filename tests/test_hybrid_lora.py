"""LoRA adapters on the hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): logits equal PEFT's on adapters of
every linear layer and of the linear-attention projections only; a batch mixing adapters and none equals each
alone in the engine, state slots and snapshots per adapter; an adapter for another layout gets a clear error."""
import json
from functools import partial

import numpy as np
import pytest

import npqwen
from npqwen.backend import to_numpy
from npqwen.errors import NpqwenError

from hybrid_checkpoints import (build_hybrid_checkpoint, hf_hybrid_model, hybrid_config, hybrid_moe_config,
                                qwen3_next_config)
from test_lora import assert_mixed_batch_equals_alone, write_adapter as write_lora_adapter
from tolerance import model_tolerance, relative_diff

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

LINEAR_ATTN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
write_adapter = partial(write_lora_adapter, load=hf_hybrid_model)   # a random PEFT adapter on the hybrid model
ADAPTERS = {   # name -> LoraConfig fields
    "all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "linear": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=LINEAR_ATTN, rank_pattern={"in_proj_qkv": 8}),
    "some": dict(r=4, lora_alpha=4, target_modules=["q_proj", "in_proj_z", "down_proj"], layers_to_transform=[1, 3]),
}


def peft_logits(base, adapter, ids):
    with torch.no_grad():
        hf = hf_hybrid_model(base)
        plain = hf(torch.tensor([ids])).logits[0].numpy()
        return peft.PeftModel.from_pretrained(hf, adapter).eval()(torch.tensor([ids])).logits[0].numpy(), plain


def check_equal_peft(llm, base, adapter, name, ids):
    """npqwen's logits through the adapter against PEFT's, within model_tolerance (both round in float32; the
    chunked linear attention's triangular solve is in the chain); the adapter moves them 10 times further."""
    want, plain = peft_logits(base, adapter, ids)
    ours = to_numpy(llm.forward(ids, lora=name))
    diff, moved, tolerance = relative_diff(ours, want), relative_diff(want, plain), model_tolerance(llm.config, len(ids))
    print(f"{name}: max |npqwen - PEFT| {np.abs(ours - want).max():.2e} (relative {diff:.2e}, tolerance "
          f"{tolerance:.1e}); the adapter moves the logits by up to {np.abs(want - plain).max():.3f}")
    assert diff <= tolerance and moved > 10 * tolerance
    assert (ours.argmax(-1) == want.argmax(-1)).all()   # the greedy token at every position


@pytest.fixture(scope="module")
def base(tmp_path_factory):   # layers 0-2 linear attention, layer 3 full attention
    return build_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_lora_base"), hybrid_config(), std=0.1)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_adapters")
    return {name: write_adapter(base, root / name, seed, **fields)
            for seed, (name, fields) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def llm(base, adapters):
    return npqwen.load(base, lora=adapters)


def test_all_linear_names_every_hybrid_projection(adapters):
    """PEFT's all-linear on Qwen3.5 is exactly what npqwen applies: four, five and three of each layer."""
    config = json.loads((adapters["all"] / "adapter_config.json").read_text())
    print("all-linear:", sorted(config["target_modules"]))
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", *LINEAR_ATTN, "gate_proj",
                                             "up_proj", "down_proj"}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_equal_peft(llm, base, adapters, name):
    ids = np.random.default_rng(0).integers(0, 500, size=70).tolist()   # 70 tokens: two chunks of the delta rule
    check_equal_peft(llm, base, adapters[name], name, ids)


def test_greedy_equals_peft(llm, base, adapters):
    ids = np.random.default_rng(1).integers(0, 500, size=7).tolist()
    with torch.no_grad():
        model = peft.PeftModel.from_pretrained(hf_hybrid_model(base), adapters["all"]).eval()
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    ours = llm.generate(ids, max_new_tokens=10, temperature=0, lora="all").token_ids
    base_ids = llm.generate(ids, max_new_tokens=10, temperature=0).token_ids
    print(f"greedy: PEFT {want}\n        npqwen {ours}\n        base {base_ids}")
    assert ours == want and ours != base_ids


def test_mixed_batch_equals_alone(llm):
    """Requests through two adapters and none share every engine step (each with its state slot); each equals
    its run alone, token for token."""
    rng = np.random.default_rng(2)
    jobs = [(rng.integers(0, 500, size=n).tolist(), lora) for n, lora in
            [(5, "all"), (9, None), (70, "linear"), (6, "all"), (3, None), (20, "linear")]]
    assert_mixed_batch_equals_alone(llm, jobs, 3, kv_cache_tokens=2048, page_size=16, max_batched_tokens=48)


def test_prefix_cache_and_state_snapshots_keyed_by_adapter(llm):
    """A prefix (its KV pages and its linear layers' state snapshot) computed under one adapter is reused under
    that adapter only."""
    prompt = np.random.default_rng(3).integers(0, 500, size=5 * 16 + 7).tolist()
    engine = npqwen.Engine(llm, kv_cache_tokens=1024, page_size=16)

    def run(lora):
        rid = engine.add_request(prompt, max_new_tokens=4, temperature=0, lora=lora)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
            engine.check()
        return out

    first = run("all")
    assert engine.stats["prefix_cache_hit_tokens"] == 0 and engine.stats["state_snapshots"] == 1
    base = run(None)                      # the same tokens without the adapter: nothing reused
    linear = run("linear")                # nor under another adapter
    assert engine.stats["prefix_cache_hit_tokens"] == 0 and engine.stats["state_snapshots"] == 3
    assert base == llm.generate(prompt, max_new_tokens=4, temperature=0).token_ids
    assert linear == llm.generate(prompt, max_new_tokens=4, temperature=0, lora="linear").token_ids
    again = run("all")                    # under its own adapter: its pages and snapshot restored
    print(f"all {first}, base {base}, linear {linear}, all again {again}; "
          f"hit tokens {engine.stats['prefix_cache_hit_tokens']}")
    assert again == first and engine.stats["prefix_cache_hit_tokens"] == 5 * 16


def edited(adapter, tmp_path, change):
    """A copy of an adapter with its tensors changed by change(tensors)."""
    from npqwen.checkpoint import read_safetensors_header, read_tensor, save_safetensors

    path = tmp_path / "edited"
    path.mkdir()
    (path / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    tensors = {}
    for key, info in read_safetensors_header(adapter / "adapter_model.safetensors").items():
        tensors[key] = np.empty(info.shape, np.float32)
        read_tensor(info, tensors[key])
    change(tensors)
    save_safetensors(path / "adapter_model.safetensors", tensors)
    return path


L0 = "base_model.model.model.layers.0"   # a linear-attention layer
F32 = np.float32
CASES = {
    "in_proj_qkv shape": (lambda t: t.update({f"{L0}.linear_attn.in_proj_qkv.lora_B.weight":
                                              np.zeros((100, 8), np.float32)}),
                          r"in_proj_qkv.lora_B.weight has shape \(100, 8\), but this base model's in_proj_qkv needs "
                          r"\(96, 'r'\) \(its weight is \(96, 64\)\)"),
    "q_proj on a linear layer": (lambda t: t.update({f"{L0}.self_attn.q_proj.lora_A.weight": np.zeros((8, 64), F32),
                                                     f"{L0}.self_attn.q_proj.lora_B.weight": np.zeros((256, 8), F32)}),
                                 r"layers.0.self_attn.q_proj.lora_A.weight: layer 0 of this base model is a "
                                 r"linear-attention \(Gated DeltaNet\) layer, which has no self_attn.q_proj \(its "
                                 r"linear layers: linear_attn.in_proj_qkv, .*\); this adapter was made for another "
                                 r"base model"),
    "in_proj_qkvz on Qwen3.5": (lambda t: t.update({f"{L0}.linear_attn.in_proj_qkvz.lora_A.weight":
                                                    np.zeros((8, 64), np.float32)}),
                                r"which has no linear_attn.in_proj_qkvz"),
    "in_proj_z on a full layer": (lambda t: t.update({"base_model.model.model.layers.3.linear_attn.in_proj_z.lora_A"
                                                      ".weight": np.zeros((8, 64), np.float32)}),
                                  r"layer 3 of this base model is a full-attention layer, which has no "
                                  r"linear_attn.in_proj_z"),
    "conv1d": (lambda t: t.update({f"{L0}.linear_attn.conv1d.lora_A.weight": np.zeros((8, 64), np.float32)}),
               r"conv1d.lora_A.weight: it is not a LoRA weight of a decoder layer's linear layers"),
    "vision tower": (lambda t: t.update({"base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight":
                                         np.zeros((8, 32), np.float32)}), r"it adapts the vision tower"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapters_get_a_clear_error(llm, adapters, tmp_path, case):
    change, message = CASES[case]
    path = edited(adapters["all"], tmp_path, change)
    with pytest.raises(NpqwenError, match=message) as e:
        llm.load_lora("bad", path)
    print(f"{case}: {e.value}")
    assert "bad" not in llm.loras


def test_a_missing_linear_attention_module_is_named(llm, adapters, tmp_path):
    key = f"{L0}.linear_attn.out_proj"
    path = edited(adapters["linear"], tmp_path, lambda t: [t.pop(f"{key}.lora_{part}.weight") for part in "AB"])
    with pytest.raises(NpqwenError, match=r"the config targets out_proj .* no weights for "
                                          r"model.layers.0.linear_attn.out_proj"):
        llm.load_lora("bad", path)


# PEFT 0.21 turns gate_proj, up_proj and down_proj on Qwen3-Next into its experts' parameters (and drops the shared
# expert's and the dense layer's): Qwen3-Next's adapter names the rest; the shared expert is Qwen3.5-MoE's to test
NEXT_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj", "shared_expert_gate"]
# name -> (config, target_modules, lora_alpha, a module it adapts). Qwen3-Next's alpha is 4: at 16 this random model
# amplifies rounding so much that npqwen's own float32 and float64 logits differ by 1.7e-3 (PEFT's by 5e-3)
CASES_MOE = {"qwen3_5_moe": (hybrid_moe_config(), "all-linear", 16, "model.layers.0.mlp.shared_expert.down_proj"),
             "qwen3_next": (qwen3_next_config(), NEXT_LINEAR, 4, "model.layers.0.linear_attn.in_proj_qkvz")}


@pytest.mark.parametrize("case", list(CASES_MOE))
def test_moe_hybrids_equal_peft(tmp_path, case):
    """Qwen3.5-MoE and Qwen3-Next: attention, the linear attention's projections (Qwen3-Next's two grouped ones),
    the shared expert's gate (and in Qwen3.5-MoE its three projections); the routed experts are parameters."""
    config, targets, alpha, module = CASES_MOE[case]
    base = build_hybrid_checkpoint(tmp_path / "base", config, std=0.1)
    adapter = write_adapter(base, tmp_path / "adapter", 7, r=8, lora_alpha=alpha, target_modules=targets)
    saved = json.loads((adapter / "adapter_config.json").read_text())
    print("targets:", sorted(saved["target_modules"]), "parameters:", saved.get("target_parameters"))
    llm = npqwen.load(base, lora={"all": adapter})
    modules = llm.lora_adapter("all").modules
    assert module in modules and "model.layers.3.mlp.shared_expert_gate" in modules
    ids = np.random.default_rng(4).integers(0, 500, size=70).tolist()
    check_equal_peft(llm, base, adapter, "all", ids)


def test_qwen3_next_all_linear_adapts_the_experts_and_is_refused(tmp_path):
    """PEFT's all-linear on Qwen3-Next also adapts the routed experts and the router (target_parameters)."""
    base = build_hybrid_checkpoint(tmp_path / "base", qwen3_next_config(), std=0.1)
    adapter = write_adapter(base, tmp_path / "adapter", 7, r=8, lora_alpha=16, target_modules="all-linear")
    with pytest.raises(NpqwenError, match=r"target_parameters is set: it adapts parameters \(MoE experts") as e:
        npqwen.load(base, lora={"all": adapter})
    print(e.value)


def test_hub_layout_adapter_equals_peft(tmp_path):
    """An adapter made on Qwen3.5's hub layout (Qwen3_5ForConditionalGeneration: model.language_model.layers...)
    applies to the text model npqwen reads."""
    base = build_hybrid_checkpoint(tmp_path / "base", hybrid_config(), std=0.1,
                                   hub_layout=True)
    adapter = write_adapter(base, tmp_path / "adapter", 8, r=4, lora_alpha=8, target_modules=LINEAR_ATTN + ["q_proj"])
    llm = npqwen.load(base, lora={"hub": adapter})
    check_equal_peft(llm, base, adapter, "hub", np.random.default_rng(5).integers(0, 500, size=9).tolist())


def test_merge_lora_equals_peft_merge_and_unload(base, adapters, tmp_path):
    from npqwen.cli import main

    out = tmp_path / "merged"
    assert main(["merge-lora", str(base), str(adapters["all"]), str(out)]) == 0
    ids = np.random.default_rng(6).integers(0, 500, size=9).tolist()
    with torch.no_grad():
        model = peft.PeftModel.from_pretrained(hf_hybrid_model(base), adapters["all"]).merge_and_unload()
        want = model(torch.tensor([ids])).logits[0].numpy()
    merged = npqwen.load(out)
    ours = to_numpy(merged.forward(ids))
    diff, tolerance = relative_diff(ours, want), model_tolerance(merged.config, len(ids))
    print(f"merge-lora vs PEFT merge_and_unload: relative max |diff| {diff:.2e} (tolerance {tolerance:.1e})")
    assert diff <= tolerance and (ours.argmax(-1) == want.argmax(-1)).all()
