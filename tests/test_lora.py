"""LoRA adapters: logits and greedy text equal to PEFT's, many adapters in one batch, the refusals."""
import json
import shutil

import numpy as np
import pytest

import npqwen
from npqwen.backend import to_numpy
from npqwen.errors import NpqwenError

from conftest import QWEN3_0_6B, build_hf_checkpoint, hf_model
from tolerance import logprob_tolerance, model_tolerance, relative_diff

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

# Qwen3-0.6B's width (D 1024, 16/8 heads of 128, F 3072) in 2 layers and a small vocabulary, to stay fast
WIDTH = {**QWEN3_0_6B, "num_hidden_layers": 2, "vocab_size": 4096, "max_position_embeddings": 1024,
         "eos_token_id": 4095, "bos_token_id": 4094}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {   # name -> LoraConfig fields: plain, rsLoRA, a per-module rank and alpha
    "plain": dict(r=8, lora_alpha=16, target_modules=ALL),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "pattern": dict(r=4, lora_alpha=8, target_modules=ALL, rank_pattern={"q_proj": 8, "down_proj": 2},
                    alpha_pattern={"v_proj": 32}),
    "some": dict(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "down_proj"], layers_to_transform=[1],
                 exclude_modules=["k_proj"]),
}


def write_adapter(base, path, seed: int, load=hf_model, **fields):
    """A random PEFT adapter with non-zero B (init_lora_weights=False) on the model `load(base)` reads, saved
    by PEFT."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(load(base), peft.LoraConfig(init_lora_weights=False, **fields))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_hf_checkpoint(tmp_path_factory.mktemp("lora_base"), WIDTH, std=0.02)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(base, root / name, seed, **fields)
            for seed, (name, fields) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def llm(base, adapters):
    return npqwen.load(base, lora=adapters)


def peft_model(base, adapter):
    return peft.PeftModel.from_pretrained(hf_model(base), adapter).eval()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_equal_peft(llm, base, adapters, name):
    ids = np.random.default_rng(0).integers(0, 4000, size=11).tolist()
    with torch.no_grad():
        want = peft_model(base, adapters[name])(torch.tensor([ids])).logits[0].numpy()
        plain = hf_model(base)(torch.tensor([ids])).logits[0].numpy()
    ours = to_numpy(llm.forward(ids, lora=name))
    rel, moved, tolerance = relative_diff(ours, want), relative_diff(want, plain), model_tolerance(llm.config, len(ids))
    print(f"{name}: max |npqwen - PEFT| {np.abs(ours - want).max():.2e} (relative {rel:.2e}, tolerance "
          f"{tolerance:.1e}); the adapter moves the logits by up to {np.abs(want - plain).max():.2f}")
    assert rel <= tolerance and moved > 10 * tolerance   # equal within rounding, and the adapter does change them
    assert (ours.argmax(-1) == want.argmax(-1)).all()


def test_greedy_equals_peft(llm, base, adapters):
    ids = np.random.default_rng(1).integers(0, 4000, size=7).tolist()
    with torch.no_grad():
        out = peft_model(base, adapters["plain"]).generate(input_ids=torch.tensor([ids]), max_new_tokens=12,
                                                           do_sample=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    ours = llm.generate(ids, max_new_tokens=12, temperature=0, lora="plain").token_ids
    base_ids = llm.generate(ids, max_new_tokens=12, temperature=0).token_ids
    print(f"greedy: PEFT {want}\n        npqwen {ours}\n        base {base_ids}")
    assert ours == want and ours != base_ids


def batched_and_alone(llm, jobs, **sizes):
    """Greedy runs of (prompt, adapter or None) jobs together through one Engine (checked after every step)
    and each alone through llm.generate: (batched tokens, alone tokens, most adapters (and none) in a step)."""
    engine = npqwen.Engine(llm, **sizes)
    ids = [engine.add_request(prompt, max_new_tokens=8, temperature=0, lora=lora) for prompt, lora in jobs]
    got, mixed = {i: [] for i in ids}, 0
    while engine.has_unfinished():
        outs = engine.step()
        engine.check()
        mixed = max(mixed, len({id(a) for a in engine.last_batch.loras}))
        for out in outs:
            got[out.request_id] += out.token_ids
    alone = [llm.generate(prompt, max_new_tokens=8, temperature=0, lora=lora).token_ids for prompt, lora in jobs]
    return [got[i] for i in ids], alone, mixed


def assert_mixed_batch_equals_alone(llm, jobs, mixed: int, **sizes) -> list:
    """batched_and_alone, asserted: each request's tokens batched equal its run alone, `mixed` adapters (and none)
    shared a step, and each adapter's tokens differ from the base model's (the adapter did something).
    Returns the tokens alone."""
    got, alone, most = batched_and_alone(llm, jobs, **sizes)
    for (prompt, lora), ours, want in zip(jobs, got, alone):
        print(f"{lora or 'base':8} prompt {len(prompt):2}: batched {ours} alone {want}")
        assert ours == want
    print(f"adapters (and none) in one step: up to {most}")
    assert most == mixed
    plain = [llm.generate(prompt, max_new_tokens=8, temperature=0).token_ids for prompt, lora in jobs if lora]
    assert all(want != base for want, base in zip([w for (_, lora), w in zip(jobs, alone) if lora], plain))
    return alone


def test_mixed_batch_equals_alone(llm):
    """Requests through three adapters and none share every engine step; each equals its run alone."""
    rng = np.random.default_rng(2)
    jobs = [(rng.integers(0, 4000, size=n).tolist(), lora) for n, lora in
            [(5, "plain"), (9, None), (3, "rslora"), (6, "pattern"), (4, "plain"), (8, None)]]
    assert_mixed_batch_equals_alone(llm, jobs, 4, kv_cache_tokens=4096, page_size=16)


def test_prefix_cache_keyed_by_adapter(llm):
    prompt = list(range(100, 140))    # 40 tokens: 2 full pages of 16
    engine = npqwen.Engine(llm, kv_cache_tokens=1024, page_size=16)

    def run(lora):
        rid = engine.add_request(prompt, max_new_tokens=2, temperature=0, lora=lora)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
        return out

    first = run("plain")
    assert engine.cache.hit_tokens == 0
    base = run(None)                   # the same tokens without the adapter: nothing reused
    assert engine.cache.hit_tokens == 0
    assert base == llm.generate(prompt, max_new_tokens=2, temperature=0).token_ids
    assert run("plain") == first and engine.cache.hit_tokens == 32   # under its own adapter: reused


def test_load_unload_and_names(llm, adapters):
    assert llm.loras == list(ADAPTERS)
    llm.load_lora("again", adapters["plain"])
    assert "again" in llm.loras
    with pytest.raises(NpqwenError, match="loaded already"):
        llm.load_lora("again", adapters["plain"])
    llm.unload_lora("again")
    with pytest.raises(NpqwenError, match=r"no LoRA adapter named 'again' is loaded \(loaded: plain, rslora"):
        llm.generate([1, 2], max_new_tokens=1, lora="again")
    ids = [5, 6, 7]
    logits = to_numpy(llm.forward(ids, lora="plain")).astype(np.float64)[:-1]                # (2, V)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    # the engine's paged batch against one forward pass: other blocks of the same sums
    got = llm.score(ids, lora="plain").logprobs
    assert np.abs(np.array(got) - logp[[0, 1], ids[1:]]).max() <= logprob_tolerance(llm.config, len(ids), logits)


def broken(adapters, tmp_path, edit_config=None, edit_tensors=None, name="broken"):
    """A copy of the "plain" adapter with its config or tensors changed."""
    from npqwen.checkpoint import read_safetensors_header, read_tensor, save_safetensors

    path = tmp_path / name
    shutil.copytree(adapters["plain"], path)
    if edit_config:
        config = json.loads((path / "adapter_config.json").read_text())
        edit_config(config)
        (path / "adapter_config.json").write_text(json.dumps(config))
    if edit_tensors:
        infos = read_safetensors_header(path / "adapter_model.safetensors")
        tensors = {}
        for key, info in infos.items():
            tensors[key] = np.empty(info.shape, np.float32)
            read_tensor(info, tensors[key])
        edit_tensors(tensors)
        save_safetensors(path / "adapter_model.safetensors", tensors)
    return path


KEY = "base_model.model.model.layers.0.self_attn.q_proj"
CASES = {
    "dora": (lambda c: c.update(use_dora=True), None, "use_dora is set: DoRA"),
    "modules_to_save": (lambda c: c.update(modules_to_save=["lm_head"]), None, "modules_to_save"),
    "lm_head target": (lambda c: c.update(target_modules=ALL + ["lm_head"]), None,
                       "'lm_head': embedding and lm_head adapters are not applied"),
    "embedding tensor": (None, lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                                                   np.zeros((8, 4096), np.float32)}), "adapts the embedding"),
    "magnitude tensor": (None, lambda t: t.update({f"{KEY}.lora_magnitude_vector.weight":
                                                   np.zeros(2048, np.float32)}), "DoRA magnitude"),
    "moe expert": (None, lambda t: t.update({"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight":
                                             np.zeros((8, 1024), np.float32)}), "Qwen3-MoE expert"),
    "other base": (None, lambda t: t.update({f"{KEY}.lora_A.weight": np.zeros((8, 2048), np.float32)}),
                   r"q_proj.lora_A.weight has shape \(8, 2048\), but this base model's q_proj needs \('r', 1024\) "
                   r"\(its weight is \(2048, 1024\)\)"),
    "rank": (lambda c: c.update(r=16), None, r"has rank 8 in the weights .* but the config says r=16"),
    "missing module": (None, lambda t: [t.pop(f"{KEY}.lora_A.weight"), t.pop(f"{KEY}.lora_B.weight")],
                       "the config targets q_proj .* no weights for model.layers.0.self_attn.q_proj"),
    "bad json": (lambda c: c.update(r="eight"), None, "r must be an integer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refusals_leave_the_rest_working(llm, adapters, tmp_path, case):
    edit_config, edit_tensors, message = CASES[case]
    path = broken(adapters, tmp_path, edit_config, edit_tensors)
    before = llm.generate([1, 2, 3], max_new_tokens=3, temperature=0, lora="rslora").token_ids
    with pytest.raises(NpqwenError, match=message) as e:
        llm.load_lora("broken", path)
    print(f"{case}: {e.value}")
    assert "broken" not in llm.loras
    assert llm.generate([1, 2, 3], max_new_tokens=3, temperature=0, lora="rslora").token_ids == before


def test_unreadable_files(llm, adapters, tmp_path):
    path = broken(adapters, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"\x09\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(NpqwenError, match="corrupt safetensors header"):
        llm.load_lora("x", path)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(NpqwenError, match="adapter_model.bin is a pickle"):
        llm.load_lora("x", path)
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(NpqwenError, match="adapter_config.json: cannot read it"):
        llm.load_lora("x", path)
    with pytest.raises(NpqwenError, match="is not a directory"):
        llm.load_lora("x", tmp_path / "nowhere")


def test_merge_lora_equals_peft_merge_and_unload(base, adapters, tmp_path):
    from npqwen.cli import main

    out = tmp_path / "merged"
    assert main(["merge-lora", str(base), str(adapters["pattern"]), str(out)]) == 0
    ids = np.random.default_rng(3).integers(0, 4000, size=9).tolist()
    with torch.no_grad():
        want = peft_model(base, adapters["pattern"]).merge_and_unload()(torch.tensor([ids])).logits[0].numpy()
    merged = npqwen.load(out)
    ours = to_numpy(merged.forward(ids))
    rel, tolerance = relative_diff(ours, want), model_tolerance(merged.config, len(ids))
    print(f"merge-lora vs PEFT merge_and_unload: max |diff| {np.abs(ours - want).max():.2e} (relative {rel:.2e}, "
          f"tolerance {tolerance:.1e})")
    assert rel <= tolerance and (ours.argmax(-1) == want.argmax(-1)).all()


def test_cli_generate_with_lora(base, adapters, capsys):
    from npqwen.cli import main

    common = ["--model", "tiny", "--raw", "-p", "hi", "--max-new-tokens", "2", "--temperature", "0"]
    assert main(["generate", *common, "--lora", f"a={adapters['plain']}"]) == 1   # made for another base
    assert "made for another base model" in capsys.readouterr().err
    assert main(["generate", *common, "--lora", "a"]) == 1
    assert "--lora takes NAME=PATH" in capsys.readouterr().err
    assert main(["generate", *common, "--lora", f"a={adapters['plain']}", "--lora-name", "b"]) == 1
    assert "--lora-name 'b' is not one of the adapters given with --lora (a)" in capsys.readouterr().err


def test_bench_lora_suite_reports_every_figure(npqwen_tiny_dir):
    """The lora suite of tools/bench, small, on a tiny checkpoint: its figures, never a time asserted."""
    import subprocess
    import sys

    from conftest import ROOT

    cmd = [sys.executable, "-m", "tools.bench", "--model", str(npqwen_tiny_dir), "--engines", "npqwen", "--suites",
           "lora", "--threads", "1", "--lora-rank", "2", "--lora-batch", "3", "--lora-context", "8", "--lora-steps",
           "2", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    ours = report["engines"]["npqwen"]
    for key in ("lora_decode_base_s", "lora_decode_lora_s", "lora_decode_adds_s", "lora_step_base_s",
                "lora_step_lora_s"):
        assert ours[key] > 0, key
    assert {"lora_decode_overhead_pct", "lora_step_overhead_pct", "lora_decode_adds_pct"} <= set(report["figures"])
