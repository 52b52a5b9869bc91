"""Qwen3-MoE: npqwen equals HF transformers' Qwen3MoeForCausalLM on random-weight checkpoints that
transformers writes (logits, hidden states, the router's choices, greedy tokens), at tiny sizes and at
the Qwen3-30B-A3B layer shape; the engine's tokens do not depend on the company; loading checks
the config against the tensors and keeps HF's names."""
import json
import re

import numpy as np
import pytest

import npqwen
from npqwen import Engine, NpqwenError
from npqwen.backend import to_numpy
from npqwen.trace import Trace

from conftest import build_hf_checkpoint, hf_model, tiny_moe_config
from tolerance import model_tolerance, relative_diff, tolerance_of

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LENGTHS = (1, 37, 300)

# name -> (config overrides, saved dtype, sharded)
CASES = {
    "top1-untied-f32": (dict(num_experts_per_tok=1, tie_word_embeddings=False), "float32", False),
    "top2-norm-tied-bf16": (dict(), "bfloat16", False),
    "top2-unnormed-untied-sharded": (dict(norm_topk_prob=False, tie_word_embeddings=False), "bfloat16", True),
    "top5of12-unnormed-dense-layer1": (dict(num_experts=12, num_experts_per_tok=5, norm_topk_prob=False,
                                            mlp_only_layers=[1]), "bfloat16", False),
    "top3-norm-sparse-step2": (dict(num_experts_per_tok=3, decoder_sparse_step=2), "float32", False),
}


def moe_checkpoint(path, case, **extra):
    overrides, save_dtype, shard = CASES[case]
    config = tiny_moe_config(max_position_embeddings=1024, **overrides, **extra)
    return build_hf_checkpoint(path, config, save_dtype=save_dtype, shard=shard, std=0.1)


def hf_forward(ref, ids):
    """HF's logits (T, V), hidden states and per-layer router logits (T, E) for one sequence."""
    with torch.no_grad():   # (ref may be on torch CUDA: tools/cuda_check_golden.py)
        out = ref(torch.tensor(np.asarray(ids), device=ref.device)[None], output_hidden_states=True,
                  output_router_logits=True)
    return (out.logits[0].cpu().numpy(), [h[0].cpu().numpy() for h in out.hidden_states],
            [r.cpu().numpy() for r in out.router_logits])


def check_against_hf(llm, ids, hf_answer):
    """Logits, each layer's output and the router's logits and choices: npqwen vs HF's answer
    (hf_forward's). Returns max |logit diff|."""
    trace = Trace()
    logits = to_numpy(llm.forward(ids, recorder=trace))
    want, hidden, router = hf_answer
    diff = np.abs(logits - want)
    cfg, T = llm.config, len(ids)
    rel, tolerance = relative_diff(logits, want), model_tolerance(cfg, T)
    mismatch = np.flatnonzero(logits.argmax(-1) != want.argmax(-1))
    report = (f"{T} tokens: max |logit diff| {diff.max():.3e} (relative {rel:.2e}, tolerance {tolerance:.1e}), "
              f"argmax mismatches at {mismatch[:10].tolist()}")
    print(report)
    assert logits.dtype == llm.model.dtype and logits.shape == want.shape
    assert rel <= tolerance and mismatch.size == 0, report
    names = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(cfg.num_hidden_layers - 1)] + ["model.norm"]
    for layers, (name, h) in enumerate(zip(names, hidden, strict=True)):   # the embedding (0 layers): exact
        err, bound = relative_diff(trace[name], h), model_tolerance(cfg, T, min(layers, cfg.num_hidden_layers))
        assert err <= bound, f"{name}: relative max |diff| {err:.3e} vs HF (tolerance {bound:.1e})"
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert len(router) == len(sparse)   # HF returns the router logits of its sparse layers only
    for i, hf_logits in zip(sparse, router):
        p = f"model.layers.{i}.mlp.gate"
        err, bound = relative_diff(trace[p], hf_logits), model_tolerance(cfg, T, i + 1)   # i layers, then the gate
        hf_top = torch.topk(torch.softmax(torch.tensor(hf_logits), -1), cfg.num_experts_per_tok, -1)
        first = np.flatnonzero((trace[f"{p}.top_k_index"] != hf_top.indices.numpy()).any(-1))
        print(f"  layer {i} router: relative max |logit diff| {err:.2e} (tolerance {bound:.1e}), "
              f"tokens routed differently: {first[:10].tolist()}")
        assert err <= bound and first.size == 0
        # the weights: a softmax (and a renormalisation) of those logits, each in [0, 1]
        assert np.abs(trace[f"{p}.top_k_weights"] - hf_top.values.numpy() / (
            hf_top.values.sum(-1, keepdim=True).numpy() if cfg.norm_topk_prob else 1)).max() <= 2 * bound
    return float(diff.max())


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(case, tmp_path):
    path = moe_checkpoint(tmp_path, case)
    llm, ref = npqwen.load(path), hf_model(path)
    assert llm.config.model_type == "qwen3_moe"
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, llm.config.vocab_size, size=T) for T in LENGTHS]
    assert ref.config._experts_implementation == "grouped_mm"   # transformers 5's default: sorted, grouped
    worst = max(check_against_hf(llm, ids, hf_forward(ref, ids)) for ids in prompts)
    ref.set_experts_implementation("eager")                     # its reference loop over the experts
    worst = max(worst, check_against_hf(llm, prompts[-1], hf_forward(ref, prompts[-1])))
    print(f"{case}: worst max |logit diff| {worst:.2e} over prompts of {LENGTHS} tokens")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """Top-2 of 8 experts, renormalised, with layer 1 dense, and HF's model of it."""
    path = moe_checkpoint(tmp_path_factory.mktemp("moe_tiny"), "top2-norm-tied-bf16", mlp_only_layers=[1])
    return path, hf_model(path)


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_equals_hf_generate(tiny_moe, length):
    from test_generate_golden import check_greedy

    path, ref = tiny_moe
    check_greedy(npqwen.load(path), ref, np.random.default_rng(length).integers(0, 512, size=length).tolist(), n=24)


# --- the engine: the same tokens whatever the company -----------------------------------------------------


@pytest.fixture(scope="module")
def moe64(tiny_moe):
    return npqwen.load(tiny_moe[0], dtype="float64")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_engine_batched_equals_alone(tiny_moe, moe64, dtype):
    from test_engine import alone, compare, prompts, run

    llm = moe64 if dtype == "float64" else npqwen.load(tiny_moe[0])
    ps = prompts([1, 5, 31, 100, 257, 300])
    news = [3 + (5 * i) % 11 for i in range(len(ps))]
    engine = Engine(llm, kv_cache_tokens=16 * 200, page_size=16, max_batched_tokens=128)
    results = run(engine, [(p, dict(max_new_tokens=n, temperature=0)) for p, n in zip(ps, news)], spy=True)
    worst = max(compare(f"{dtype} prompt {len(p)}", r[0], r[1], *alone(llm, p, n))
                for p, n, r in zip(ps, news, results))
    assert worst <= tolerance_of(llm, 300 + max(news))


def test_engine_chunked_prefix_cache_and_preemption(moe64):
    from test_engine import compare, prompts, run

    P = 16
    ps = prompts([200, 33, 70], seed=3)
    reqs = [(p, dict(max_new_tokens=6, temperature=0)) for p in ps]
    whole = run(Engine(moe64, kv_cache_tokens=4096, page_size=P, max_batched_tokens=2048), reqs, spy=True)
    chunked = run(Engine(moe64, kv_cache_tokens=4096, page_size=P, max_batched_tokens=7), reqs, spy=True)
    for p, a, b in zip(ps, whole, chunked):
        assert compare(f"chunked, prompt {len(p)}", b[0], b[1], a[0], a[1]) <= tolerance_of(moe64, 200 + 6)
    engine = Engine(moe64, kv_cache_tokens=64 * P, page_size=P)
    run(engine, [(ps[0], reqs[0][1])])
    (hit, hit_logits, _), = run(engine, [(ps[0][:5 * P] + ps[1], reqs[0][1])], spy=True)
    assert engine.stats["prefix_cache_hit_tokens"] == 5 * P
    (miss, miss_logits, _), = run(Engine(moe64, kv_cache_tokens=64 * P, page_size=P, prefix_cache=False),
                                  [(ps[0][:5 * P] + ps[1], reqs[0][1])], spy=True)
    assert compare("prefix hit vs miss", hit, hit_logits, miss, miss_logits) <= tolerance_of(moe64, 5 * P + 33 + 6)
    squeezed = prompts([30, 45, 20, 60], seed=8)
    long = [(p, dict(max_new_tokens=40, temperature=0)) for p in squeezed]
    roomy = run(Engine(moe64, kv_cache_tokens=64 * P, page_size=P), long)
    tight = Engine(moe64, kv_cache_tokens=8 * P, page_size=P)
    assert [r[0] for r in run(tight, long)] == [r[0] for r in roomy] and tight.stats["preemptions"] > 0


def test_generate_chat_and_a_seeded_draw(moe64):
    ps = [[1, 2, 3], list(range(40, 90))]
    together = moe64.generate(ps, max_new_tokens=8, temperature=0)
    assert [r.token_ids for r in together] == [moe64.generate(p, max_new_tokens=8, temperature=0).token_ids
                                                for p in ps]
    a = moe64.generate(ps[1], max_new_tokens=12, temperature=1.0, top_k=50, seed=5).token_ids
    assert a == moe64.generate(ps[1], max_new_tokens=12, temperature=1.0, top_k=50, seed=5).token_ids
    tiny = npqwen.load("tiny-moe")                          # with a tokenizer and Qwen3's chat template
    answer = tiny.chat("Which experts?", enable_thinking=False, max_new_tokens=10, temperature=0)
    want = tiny.generate(tiny.chat_prompt("Which experts?", enable_thinking=False), max_new_tokens=10,
                         temperature=0)
    assert answer.token_ids == want.token_ids and answer.messages[-1]["role"] == "assistant"


def test_compare_module_by_module_with_hf(tiny_moe):
    """npqwen.compare (what `npqwen compare` prints): every step of a sparse and a dense layer vs HF's hooks."""
    from npqwen.compare import compare

    rows = compare(npqwen.load(tiny_moe[0]), np.random.default_rng(9).integers(0, 512, size=33).tolist())
    names = {r["name"]: r for r in rows}
    for name in ("model.layers.0.mlp.gate", "model.layers.0.mlp.gate.top_k_weights", "model.layers.0.mlp.experts",
                 "model.layers.1.mlp.gate_proj", "model.layers.2.mlp.experts", "lm_head"):
        assert names[name]["ok"], names[name]
    assert names["model.layers.2.mlp.gate.top_k_index"]["max_abs_diff"] == 0   # the same experts, exactly
    assert all(r["ok"] for r in rows) and len(rows) == 59   # 3 + 3 layers x 18 steps + 2


# --- the command line: inspect, trace, compare, generate on a Qwen3-MoE; the benchmark's moe suite --------


def test_bench_moe_suite_reports_every_figure(tmp_path):
    """The moe suite on a tiny checkpoint: every figure is there (it never asserts a time)."""
    import subprocess
    import sys

    from conftest import ROOT, write_npqwen_checkpoint

    path = write_npqwen_checkpoint(tmp_path / "moe", tiny_moe_config(mlp_only_layers=[1]), dtype="BF16")
    cmd = [sys.executable, "-m", "tools.bench", "--model", str(path), "--suites", "moe", "--moe-prefill", "64",
           "--moe-batch", "4", "--moe-context", "16", "--repeats", "1", "--engines", "npqwen,hf-float32", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    ours, hf = report["engines"]["npqwen"], report["engines"]["hf-float32"]
    assert {"moe_prefill_s", "moe_prefill_experts_s", "moe_prefill_matmul_s", "moe_batch_s"} <= set(ours)
    assert {"moe_prefill_s", "moe_prefill_eager_s", "moe_batch_s", "moe_batch_eager_s"} <= set(hf)
    assert 0 < ours["moe_prefill_experts_s"] < ours["moe_prefill_matmul_s"]
    assert {"moe_prefill_pct_of_matmul", "moe_batch_pct_of_experts", "moe_batch_vs_hf-float32"} <= set(
        report["figures"])
    refused = subprocess.run([sys.executable, "-m", "tools.bench", "--suites", "moe,decode"], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
    assert refused.returncode == 2 and "run it alone, --suites moe" in refused.stderr


def test_inspect_folds_the_experts_and_counts_active_parameters(tiny_moe):
    from npqwen.checkpoint import parameter_counts
    from test_cli import run

    path, ref = tiny_moe
    code, out, err = run("inspect", "--model", str(path))
    assert code == 0, err
    assert "model.layers.0.mlp.experts.{0..7}.gate_proj.weight   [32, 64]" in out and ".experts.5." not in out
    assert "model.layers.1.mlp.gate_proj.weight" in out and "mlp_only_layers            (1,)" in out
    total, active = parameter_counts(npqwen.Qwen3Config.from_json(path / "config.json"))
    assert total == sum(p.numel() for p in ref.parameters())   # torch lists the tied lm_head once too
    assert f"unique parameters: {total:,}" in out and f"active per token:  {active:,}  (2 of 8 experts" in out
    assert active == total - 2 * 6 * 3 * 32 * 64            # 2 sparse layers, 6 experts idle, 3 (32, 64) matrices
    code, out, err = run("inspect", "--model", "tiny")
    assert code == 0 and "num_experts" not in out and "active per token" not in out


def test_trace_and_generate_on_tiny_moe():
    from test_cli import run

    code, out, err = run("trace", "--model", "tiny-moe", "--prompt", "Route me", "--layers", "1")
    assert code == 0, err
    assert "model.layers.1.mlp.gate.top_k_index      (8, 2)" in out and "model.layers.0.mlp" not in out
    assert re.search(r"model\.layers\.1\.mlp\.gate: tokens per expert \[[\d, ]+\]", out)
    code, out, err = run("generate", "--model", "tiny-moe", "--raw", "--prompt", "Hi", "-t", "0", "-n", "6")
    assert code == 0 and "generation: 6 tokens" in err, err


# --- loading: HF's names, views into the expert arrays, the config checked against the tensors ---------


def test_weights_keep_hf_names_as_views_of_the_expert_arrays(tiny_moe):
    from safetensors.torch import load_file

    path, _ = tiny_moe
    llm = npqwen.load(path)
    stored = load_file(path / "model.safetensors")   # what save_pretrained wrote: one tensor per expert
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in stored and "model.layers.1.mlp.gate_proj.weight" in stored
    assert set(llm.weights) == set(stored) | {"lm_head.weight"}
    gate_up, down = (llm.model.fused[f"model.layers.0.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj"))
    assert gate_up.shape == (8, 64, 64) and down.shape == (8, 64, 32)     # (E, 2I, D), (E, D, I)
    for e in range(8):
        for part, whole in (("gate_proj", gate_up[e, :32]), ("up_proj", gate_up[e, 32:]), ("down_proj", down[e])):
            w = llm.weights[f"model.layers.0.mlp.experts.{e}.{part}.weight"]
            assert np.shares_memory(w, whole) and np.array_equal(w, whole)
            want = stored[f"model.layers.0.mlp.experts.{e}.{part}.weight"].float().numpy()
            assert np.array_equal(w, want)
    assert "model.layers.1.mlp.gate_up_proj.weight" in llm.model.fused     # the dense layer as before


def test_config_keys_as_the_hub_and_transformers_write_them():
    from transformers import Qwen3MoeConfig

    from npqwen.config import MOE_DEFAULTS, QWEN3_30B_A3B_CONFIG

    c = npqwen.Qwen3Config.from_dict(QWEN3_30B_A3B_CONFIG)   # the hub's config.json says num_experts
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert c.mlp_only_layers == () and all(c.is_moe_layer(i) for i in range(48))
    saved = dict(QWEN3_30B_A3B_CONFIG)                       # save_pretrained writes num_local_experts
    saved["num_local_experts"] = saved.pop("num_experts")
    assert npqwen.Qwen3Config.from_dict(saved) == c
    hf = Qwen3MoeConfig()                                     # keys left out take transformers' defaults
    assert {k: getattr(hf, k) or None for k in MOE_DEFAULTS} == {k: v or None for k, v in MOE_DEFAULTS.items()}
    bare = {k: v for k, v in QWEN3_30B_A3B_CONFIG.items() if k not in MOE_DEFAULTS}
    assert npqwen.Qwen3Config.from_dict(bare).norm_topk_prob is False
    rule = npqwen.Qwen3Config.from_dict(dict(QWEN3_30B_A3B_CONFIG, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [i for i in range(8) if rule.is_moe_layer(i)] == [1, 5, 7]   # as Qwen3MoeDecoderLayer decides
    dense = npqwen.Qwen3Config.from_dict(dict(QWEN3_30B_A3B_CONFIG, model_type="qwen3"))
    assert dense.num_experts == 0 and "num_experts" not in dense.to_dict()
    assert c.to_dict()["model_type"] == "qwen3_moe" and c.to_dict()["mlp_only_layers"] == []


def test_saved_checkpoint_loads_in_transformers(tiny_moe, tmp_path):
    path, ref = tiny_moe
    llm = npqwen.load(path)
    again = hf_model(llm.save(tmp_path / "copy"))
    ids = list(range(20, 60))
    with torch.no_grad():
        a, b = (m(torch.tensor([ids])).logits[0].numpy() for m in (ref, again))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("edit, message", [
    (dict(num_experts=16), "config.json says num_experts is 16 but the checkpoint holds 8 experts per layer"),
    (dict(num_experts=10**9), "num_experts is 1000000000 but the checkpoint holds 8 experts"),
    (dict(num_experts=4), "config.json says num_experts is 4 but model.layers.0.mlp.gate.weight has rows 8"),
    (dict(moe_intermediate_size=16), "moe_intermediate_size is 16 but model.layers.0.mlp.experts.0.gate_proj"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok must be between 1 and num_experts"),
    (dict(mlp_only_layers=[3]), "mlp_only_layers \\[3\\] names layer 3, but the model has layers 0 .. 2"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be between 1"),
    (dict(mlp_only_layers=[0]), "tensor 'model.layers.0.mlp.gate_proj.weight' is missing"),
])
def test_a_config_that_does_not_match_the_tensors_is_refused(tiny_moe, tmp_path, edit, message):
    import shutil

    shutil.copy(tiny_moe[0] / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((tiny_moe[0] / "config.json").read_text())
    config.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 8, **config, **edit}))
    with pytest.raises(NpqwenError, match=message):
        npqwen.load(tmp_path)


def test_dense_and_moe_configs_swapped_are_refused(tiny_moe, npqwen_tiny_dir, tmp_path):
    import shutil

    for weights, config, message in (
            (tiny_moe[0], tiny_moe_config(model_type="qwen3"), "holds 8 experts per layer \\(a Qwen3-MoE\\) but"),
            (npqwen_tiny_dir, tiny_moe_config(), "holds no experts: it is a dense checkpoint")):
        shutil.copy(weights / "model.safetensors", tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(NpqwenError, match=message):
            npqwen.load(tmp_path)


def test_fused_experts_on_disk_are_refused_with_the_reason(tmp_path):
    from npqwen.checkpoint import save_safetensors

    config = tiny_moe_config(num_hidden_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_safetensors(tmp_path / "model.safetensors", {
        "model.embed_tokens.weight": np.zeros((512, 64), np.float32),
        "model.layers.0.mlp.experts.gate_up_proj": np.zeros((8, 64, 64), np.float32)})
    with pytest.raises(NpqwenError, match="stores its experts fused .* one tensor per expert"):
        npqwen.load(tmp_path)


def test_weights_that_cannot_fit_are_refused_before_reading(tiny_moe, monkeypatch):
    from npqwen import checkpoint

    monkeypatch.setattr(checkpoint, "free_memory_bytes", lambda xp: 2**19)
    monkeypatch.setattr(checkpoint, "read_tensor", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(NpqwenError, match=r"the weights need 1.7 MiB in float64 but the host has 0.5 MiB free"):
        npqwen.load(tiny_moe[0], dtype="float64")


# --- Qwen3-30B-A3B's layer shape: 2 layers, the real vocabulary (heavy: run under the shared lock) ------

A3B_LAYERS = dict(num_hidden_layers=2, max_window_layers=2, max_position_embeddings=4096)
A3B_PROMPTS = {"logits_1": 1, "logits_300": 300, "greedy": 12}   # prompt lengths
A3B_NEW_TOKENS = 8


def write_a3b_checkpoint_and_hf_answers(path):
    """Run in a process of its own by the `a3b` fixture: transformers writes a random 2-layer checkpoint of
    Qwen3-30B-A3B's shape (bf16, 3.7 GB) and, in float32, its answers for the prompts into hf_answers.npz.
    The process then exits, so HF's 7.5 GB go back to the OS before npqwen loads its own."""
    from pathlib import Path

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.initialization import no_init_weights

    from npqwen.config import QWEN3_30B_A3B_CONFIG
    from test_generate_golden import hf_greedy

    path = Path(path)
    torch.manual_seed(0)
    cfg = {k: v for k, v in dict(QWEN3_30B_A3B_CONFIG, **A3B_LAYERS).items()
           if k not in ("model_type", "architectures", "torch_dtype")}
    torch.set_default_dtype(torch.bfloat16)   # made in bf16, as saved: half the memory
    with no_init_weights():                    # random weights below; HF's own initialisation would double the time
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    ref = model.float().eval()   # bf16 -> float32 is exact: the float32 model HF loads from these files
    rng = np.random.default_rng(5)
    answers = {}
    for key, T in A3B_PROMPTS.items():
        ids = rng.integers(0, 151_643, size=T)
        answers[f"{key}.ids"] = ids
        if key == "greedy":
            answers["greedy.tokens"] = np.array(hf_greedy(ref, ids.tolist(), A3B_NEW_TOKENS))
            continue
        logits, hidden, router = hf_forward(ref, ids)
        answers.update({f"{key}.logits": logits, **{f"{key}.hidden.{i}": h for i, h in enumerate(hidden)},
                        **{f"{key}.router.{i}": r for i, r in enumerate(router)}})
    np.savez(path / "hf_answers.npz", **answers)


@pytest.fixture(scope="module")
def a3b(tmp_path_factory):
    """The Qwen3-30B-A3B-shaped checkpoint (hidden 2048, 32/4 heads of 128, 128 experts of width 768, 8 per
    token, untied vocabulary of 151936; 2 layers) and HF's float32 answers on it, made in a subprocess."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path_factory.mktemp("qwen3-30b-a3b-shape")
    here = Path(__file__).parent
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import test_moe; "
            f"test_moe.write_a3b_checkpoint_and_hf_answers(sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = dict(np.load(path / "hf_answers.npz"))

    def answer(key):   # as hf_forward returns it
        n = sum(k.startswith(f"{key}.hidden.") for k in answers)
        m = sum(k.startswith(f"{key}.router.") for k in answers)
        return (answers[f"{key}.logits"], [answers[f"{key}.hidden.{i}"] for i in range(n)],
                [answers[f"{key}.router.{i}"] for i in range(m)])

    return path, answers, answer


def test_qwen3_30b_a3b_layer_shape_matches_hf(a3b):
    from test_engine import alone, compare, prompts, run

    path, answers, answer = a3b
    llm = npqwen.load(path)
    assert llm.config.num_experts == 128 and len(llm.weights) == 3 + 2 * (8 + 1 + 3 * 128)
    for key in ("logits_1", "logits_300"):
        check_against_hf(llm, answers[f"{key}.ids"], answer(key))
    ours = llm.generate(answers["greedy.ids"].tolist(), max_new_tokens=A3B_NEW_TOKENS, temperature=0).token_ids
    print(f"greedy: npqwen {ours}, HF {answers['greedy.tokens'].tolist()}")
    assert ours == answers["greedy.tokens"].tolist()
    ps = prompts([5, 300], seed=2, vocab=151_643)
    results = run(Engine(llm, kv_cache_tokens=2048, page_size=64, max_batched_tokens=256),
                  [(p, dict(max_new_tokens=4, temperature=0)) for p in ps], spy=True)
    worst = max(compare(f"A3B shape prompt {len(p)}", r[0], r[1], *alone(llm, p, 4)) for p, r in zip(ps, results))
    assert worst <= tolerance_of(llm, 300 + 4)
