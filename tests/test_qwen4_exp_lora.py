"""LoRA adapters on Qwen4-Exp: PEFT's all-linear (every projection: attention, the QSA indexer, the Gated DeltaNet,
the shared expert and its gate, each layer's two hyper-connections and the final mixing, PLE's key and value) and a
few modules on some layers give PEFT's logits; requests through two adapters and none, batched and chunked in the
engine, equal each alone; merge-lora equals PEFT's merge_and_unload; an adapter for another layout, or of the
routed experts, is refused by name."""
import json

import numpy as np
import pytest

import npqwen
from npqwen.errors import NpqwenError
from npqwen.lora import LINEAR, layer_modules, model_modules

from test_hybrid_lora import edited
from test_lora import assert_mixed_batch_equals_alone, write_adapter
from test_qwen4_exp import MODEL, build, qwen4
from test_qwen4_exp_steer_spec import answers_known
from tolerance import model_tolerance, relative_diff

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

ADAPTERS = {   # name -> LoraConfig fields
    "all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "some": dict(r=4, lora_alpha=4, use_rslora=True, layers_to_transform=[0, 3], rank_pattern={"index_qk_proj": 8},
                 target_modules=["q_proj", "index_qk_proj", "key_proj", "in_proj_z", "input_mix_weight_up",
                                 "down_proj"]),
}


def hf_model(base):
    return qwen4.Qwen4ExpForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):   # layers 0-2 Gated DeltaNet, 3 QSA; PLE on 0 and 1; C=3 streams
    return build(tmp_path_factory.mktemp("qwen4_lora_base"))[0]


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_adapters")
    return {name: write_adapter(base, root / name, seed, load=hf_model, **fields)
            for seed, (name, fields) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def llm(base, adapters):
    return npqwen.load(base, lora=adapters)


def prompt(n: int, seed: int = 0) -> list[int]:
    ids = np.random.default_rng(seed).integers(0, MODEL["vocab_size"], n).tolist()
    ids[7:9] = [MODEL["eos_token_id"]] * 2 if n > 9 else ids[7:9]   # PLE's n-grams stop at an end of text
    return ids


def test_all_linear_is_every_projection_npqwen_adapts(llm, adapters):
    """PEFT's all-linear on Qwen4-Exp names 19 projections (no expert: they are parameters); npqwen applies each, on
    every layer that has it and on the final mixing outside the layers."""
    config = json.loads((adapters["all"] / "adapter_config.json").read_text())
    print("all-linear:", sorted(config["target_modules"]), "parameters:", config.get("target_parameters"))
    assert set(config["target_modules"]) == set(LINEAR) - {"in_proj_qkvz", "in_proj_ba"}   # (Qwen3-Next's)
    cfg, modules = llm.config, llm.lora_adapter("all").modules
    want = [f"model.layers.{i}.{m}" for i in range(cfg.num_hidden_layers) for m in layer_modules(cfg, i)]
    assert sorted(modules) == sorted(want + model_modules(cfg)) and len(modules) == 66
    assert {"model.layers.0.ple.value_proj", "model.layers.3.self_attn.indexer.index_qk_proj",
            "model.hyper_connection_mixer.input_mix_weight_down"} <= set(modules)


@pytest.fixture(scope="module")
def plain(base):   # HF's logits without an adapter, of a prompt of 40 tokens
    with torch.no_grad():
        return hf_model(base)(torch.tensor([prompt(40)])).logits[0].numpy()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_equal_peft(llm, base, adapters, plain, name):
    ids = prompt(40)   # 40 tokens: the QSA layer keeps 2 blocks of 4 and the tail, of up to 40
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(hf_model(base), adapters[name]).eval()(torch.tensor([ids])).logits[0]
    want, ours = want.numpy(), llm.forward(ids, lora=name)
    diff, moved = relative_diff(ours, want), relative_diff(want, plain)
    tolerance = model_tolerance(llm.config, len(ids))
    print(f"{name} ({len(llm.lora_adapter(name).modules)} modules): max |npqwen - PEFT| "
          f"{np.abs(ours - want).max():.2e} (relative {diff:.2e}, tolerance {tolerance:.1e}); the adapter moves the "
          f"logits by up to {np.abs(want - plain).max():.3f}")
    assert diff <= tolerance and moved > 10 * tolerance
    assert (ours.argmax(-1) == want.argmax(-1)).all()


def test_two_adapters_and_none_batched_equal_each_alone(base, adapters):
    """Prompts through "all", "some" and no adapter share engine steps (chunked over small pages: PLE's convolution
    and QSA's selection continue across chunks, each request with its own adapter); each equals its run alone, token
    for token (float64: only the order of sums differs); so does a request through an adapter with ngram drafts."""
    llm = npqwen.load(base, dtype="float64", lora=adapters)
    jobs = [(prompt(n, seed), lora) for seed, (n, lora) in enumerate([(5, "all"), (30, "some"), (12, None),
                                                                       (40, "all"), (3, "some")])]
    assert_mixed_batch_equals_alone(llm, jobs, 3, kv_cache_tokens=512, page_size=8, max_batched_tokens=24)
    ids = prompt(20, 9)   # drafts (4 in 5 right) verified token by token through PLE, with the adapter's updates
    want = llm.generate(ids, max_new_tokens=12, temperature=0, lora="all").token_ids
    engine = npqwen.Engine(llm, kv_cache_tokens=512, page_size=8)
    engine.propose = answers_known([ids], [want], False, 0.2)
    engine.add_request(ids, max_new_tokens=12, temperature=0, lora="all", speculative={"method": "ngram", "k": 3})
    drafted = []
    while engine.has_unfinished():
        drafted += [t for o in engine.step() for t in o.token_ids]
    kept, drafts = engine.stats["spec_decode_num_accepted_tokens"], engine.stats["spec_decode_num_draft_tokens"]
    print(f"with drafts: {drafted} ({kept} of {drafts} drafts kept)")
    assert drafted == want and 0 < kept < drafts


def test_merge_lora_equals_peft_merge_and_unload(base, adapters, tmp_path):
    """npqwen merge-lora writes the merged Qwen4-Exp (its PLE tables as the shards transformers writes)."""
    from npqwen.cli import main

    out = tmp_path / "merged"
    assert main(["merge-lora", str(base), str(adapters["all"]), str(out)]) == 0
    ids = prompt(20, 1)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(hf_model(base), adapters["all"]).merge_and_unload()(
            torch.tensor([ids])).logits[0].numpy()
    merged = npqwen.load(out)
    ours = merged.forward(ids)
    diff, tolerance = relative_diff(ours, want), model_tolerance(merged.config, len(ids))
    print(f"merge-lora vs PEFT merge_and_unload: relative max |diff| {diff:.2e} (tolerance {tolerance:.1e})")
    assert diff <= tolerance and (ours.argmax(-1) == want.argmax(-1)).all()


L = "base_model.model.model.layers"
CASES = {   # an adapter of another layout: a module the layer does not have
    "indexer on a linear layer": ({f"{L}.0.self_attn.indexer.index_qk_proj.lora_A.weight": (4, 32)},
                                  r"layer 0 of this base model is a linear-attention \(Gated DeltaNet\) layer .*which "
                                  r"has no self_attn.indexer.index_qk_proj"),
    "PLE on a layer without": ({f"{L}.3.ple.key_proj.lora_A.weight": (4, 8)}, r"which has no ple.key_proj"),
    "in_proj_qkvz": ({f"{L}.0.linear_attn.in_proj_qkvz.lora_A.weight": (4, 32)},
                     r"which has no linear_attn.in_proj_qkvz"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_adapter_for_another_layout_is_refused_by_name(llm, adapters, tmp_path, case):
    extra, message = CASES[case]
    path = edited(adapters["all"], tmp_path, lambda t: t.update({k: np.zeros(s, np.float32) for k, s in extra.items()}))
    with pytest.raises(NpqwenError, match=message) as e:
        llm.load_lora("bad", path)
    print(f"{case}: {e.value}")
    assert "bad" not in llm.loras


def test_an_adapter_of_the_routed_experts_is_refused(base, tmp_path):
    """PEFT reaches Qwen4-Exp's routed experts (stacked parameters, mlp.experts.gate_up_proj) only by
    target_parameters, which npqwen refuses by name, as for the other MoE models."""
    path = write_adapter(base, tmp_path / "experts", 3, load=hf_model, r=4, target_modules=["q_proj"],
                         target_parameters=["mlp.experts.gate_up_proj"])
    with pytest.raises(NpqwenError, match=r"target_parameters is set: it adapts parameters \(MoE experts") as e:
        npqwen.load(base, lora={"experts": path})
    print(e.value)
