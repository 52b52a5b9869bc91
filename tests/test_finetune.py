"""LoRA fine-tuning without torch (npqwen/finetune.py) against PEFT + torch on CPU: the same base, the same initial
adapter, data and order, AdamW: each of 20 steps' loss within 1e-4 relative, the adapter after 20 steps within
1e-3; the adapter it writes loads in PEFT and in npqwen. Then the data file's errors, each naming the line."""
import json

import numpy as np
import pytest

import npqwen
from npqwen import finetune as ft

from conftest import build_hf_checkpoint, hf_model, tiny_config

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
STEPS, ACCUMULATE, LR = 20, 2, 5e-3


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_hf_checkpoint(tmp_path_factory.mktemp("ft_base"), tiny_config(num_hidden_layers=2),
                               save_dtype="float32", std=0.1)


def examples(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [ft.example(rng.integers(0, 512, 5).tolist(), rng.integers(0, 512, int(rng.integers(3, 7))).tolist())
            for _ in range(n)]


def peft_training(base, adapter_dir, data, load=hf_model, steps=STEPS, accumulate=ACCUMULATE):
    """The same loop in torch: PEFT's model of the same adapter (on `load(base)`, in its dtype), HF's loss from
    labels, torch's AdamW."""
    hf = load(base)
    model = peft.PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True).to(hf.dtype).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        batch, total = [data[(step * accumulate + j) % len(data)] for j in range(accumulate)], 0.0
        for ex in batch:
            labels = np.append(-100, ex.targets[:-1])        # HF shifts the labels itself: label t+1 at row t
            out = model(input_ids=torch.from_numpy(ex.ids)[None], labels=torch.from_numpy(labels)[None])
            (out.loss / len(batch)).backward()
            total += out.loss.item() / len(batch)
        optimizer.step()
        losses.append(total)
    state = peft.get_peft_model_state_dict(model)
    return losses, {k: v.detach().numpy() for k, v in state.items()}, model


def test_twenty_steps_match_peft_and_torch(base, tmp_path):
    llm = npqwen.load(base)
    adapter = ft.new_adapter(llm.model, r=4, alpha=8, targets=ft.TARGETS, seed=0)   # all seven (PEFT's default: 2)
    rng = np.random.default_rng(1)
    for name, a in adapter.weights.items():   # B non-zero from the start, so every path has a gradient at step 1
        if "lora_B" in name:
            a[...] = 0.05 * rng.standard_normal(a.shape)
    ft.save_adapter(adapter, tmp_path / "initial")
    data = examples()
    torch_losses, torch_adapter, _ = peft_training(base, tmp_path / "initial", data)
    optimizer = ft.AdamW(adapter.weights, lr=LR)
    losses = [ft.train_step(llm.model, adapter, [data[(s * ACCUMULATE + j) % len(data)] for j in range(ACCUMULATE)],
                            optimizer) for s in range(STEPS)]
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses))
    print("losses npqwen", np.round(losses, 5))
    print("losses torch ", np.round(torch_losses, 5))
    worst = max((rel(adapter.weights[k.removeprefix("base_model.model.")], v), k) for k, v in torch_adapter.items())
    print(f"loss: worst relative difference {worst_loss:.1e}; adapter after {STEPS} steps: {worst[0]:.1e} ({worst[1]})")
    assert len(torch_adapter) == len(adapter.weights) == 2 * 7 * 2
    assert losses[-1] < losses[0] - 0.5          # it learns
    assert worst_loss < 1e-4 and worst[0] < 1e-3
    # the trained adapter: PEFT loads it, and npqwen serves it with PEFT's logits
    ft.save_adapter(adapter, tmp_path / "trained")
    reloaded = peft.PeftModel.from_pretrained(hf_model(base), tmp_path / "trained").eval()
    with torch.no_grad():
        expected = reloaded(torch.tensor([data[0].ids])).logits[0].numpy()
    llm.load_lora("trained", tmp_path / "trained")
    got = llm.forward(data[0].ids, lora="trained")
    print(f"served: max |npqwen - PEFT| logits {np.abs(got - expected).max():.1e}")
    assert np.abs(got - expected).max() < 1e-4


def test_the_default_targets_are_peft_s(base):
    """new_adapter's default targets are PEFT's (LoraConfig's target_modules=None) where PEFT has an entry for the
    model type: on a Qwen3 the very modules PEFT adapts (q_proj, v_proj); PEFT has none for Qwen3-MoE, Qwen3.5(-MoE)
    or Qwen4-Exp (by npqwen's model type or the hub's), and there the default stays npqwen's lora.TARGETS."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    hf = peft.get_peft_model(hf_model(base), peft.LoraConfig(r=2))
    want = {k.removeprefix("base_model.model.") for k in peft.get_peft_model_state_dict(hf)}
    got = set(ft.new_adapter(npqwen.load(base).model, r=2).weights)
    print(f"Qwen3: PEFT adapts {len(want) // 2} modules, npqwen {len(got) // 2}; differ: {sorted(want ^ got)[:4]}")
    assert got == want and len(got) == 2 * 2 * 2
    for model_type, targets in ft.PEFT_TARGETS.items():   # qwen2 too
        assert set(PEFT[model_type]) == set(targets), model_type
    for model in ("tiny-moe", "tiny-qwen3.5", "tiny-qwen4-exp"):
        llm = npqwen.load(model)
        types = {llm.config.model_type, llm.config.model_type.removesuffix("_text")}   # qwen3_5_text, qwen3_5
        adapted = {n.split(".")[-3] for n in ft.new_adapter(llm.model, r=2).weights}   # ...q_proj.lora_A.weight
        print(f"{model} {sorted(types)}: PEFT {[PEFT.get(t) for t in types]}, npqwen {sorted(adapted)}")
        assert not any(t in PEFT for t in types) and ft.default_targets(llm.config) == ft.TARGETS
        assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= adapted <= set(ft.TARGETS)


def test_qwen4_exp_steps_match_peft_and_torch_in_float64(tmp_path, monkeypatch):
    """Qwen4-Exp with an adapter on every projection PEFT's all-linear adapts there (attention's, the QSA indexer's,
    the Gated DeltaNet's, the shared expert's and its gate, the hyper-connections' and the final mixing's, PLE's), 3
    AdamW steps in float64 against PEFT + torch (HF's float32 casts kept float64, tests/test_backward.py): the losses
    and the adapter. The indexer's adapter reaches the output only through the block selection, a step: torch leaves
    its .grad None and does not step it, nor does npqwen. (Float32 differs from torch by rounding that Adam's first
    steps, which follow each gradient's sign, magnify on the near-zero entries; float64 shows the math is the same.)"""
    from npqwen import lora

    from test_backward import float64_hf
    from test_qwen4_exp import build, qwen4

    base = build(tmp_path / "base")[0]                    # 4 layers: DeltaNet x3 (2 with PLE), QSA; C=3 streams
    llm = npqwen.load(base, dtype="float64")
    adapter = ft.new_adapter(llm.model, r=4, alpha=8, targets=lora.LINEAR)
    rng = np.random.default_rng(1)
    for name, a in adapter.weights.items():   # B non-zero from the start; every value as the float32 file holds it
        if "lora_B" in name:
            a[...] = 0.05 * rng.standard_normal(a.shape)
        a[...] = a.astype(np.float32)
    ft.save_adapter(adapter, tmp_path / "initial")
    indexer = {n: a.copy() for n, a in adapter.weights.items() if ".indexer." in n}

    def load(path):
        hf = qwen4.Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.config._experts_implementation = "eager"        # (grouped_mm takes no float64)
        return float64_hf(hf, llm, monkeypatch, hybrid=True)
    rng = np.random.default_rng(0)
    data = [ft.example(rng.integers(0, 300, 8).tolist(), rng.integers(0, 300, 6).tolist()) for _ in range(3)]
    torch_losses, torch_adapter, model = peft_training(base, tmp_path / "initial", data, load, steps=3, accumulate=1)
    optimizer = ft.AdamW(adapter.weights, lr=LR)
    losses = [ft.train_step(llm.model, adapter, [ex], optimizer) for ex in data]
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses))
    worst = max((rel(adapter.weights[k.removeprefix("base_model.model.")], v), k) for k, v in torch_adapter.items())
    print("losses npqwen", losses, "torch", torch_losses)
    print(f"{len(adapter.weights)} adapter weights; loss: worst relative difference {worst_loss:.1e}; adapter after 3 "
          f"steps: {worst[0]:.1e} ({worst[1]})")
    untouched = {n.removeprefix("base_model.model.").replace(".default", "") for n, p in model.named_parameters()
                 if p.requires_grad and p.grad is None}
    assert len(torch_adapter) == len(adapter.weights) == 132 and untouched == set(indexer)
    assert all(np.array_equal(adapter.weights[n], a) for n, a in indexer.items())
    assert worst_loss < 1e-12 and worst[0] < 1e-9


def test_data_file_errors_name_the_line(tmp_path):
    llm = npqwen.load("tiny")
    good = json.dumps({"prompt": "2+2=", "completion": "4"})
    cases = [("", r"no examples \(the file is empty\)"),
             (good + "\n{not json", "line 2: not JSON"),
             (good + "\n" + json.dumps({"text": "x"}), "line 2: an example is"),
             (json.dumps({"prompt": "a", "completion": ""}), "line 1: no answer token"),
             (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "line 1: an example is")]
    for text, says in cases:
        path = tmp_path / "data.jsonl"
        path.write_text(text)
        with pytest.raises(npqwen.NpqwenError, match=says):
            ft.read_examples(path, llm.tokenizer)
    path.write_text(good)
    with pytest.raises(npqwen.NpqwenError, match="line 1: 5 tokens, more than --max-tokens 3"):
        ft.read_examples(path, llm.tokenizer, max_tokens=3, too_long="refuse")
    cut = ft.read_examples(path, llm.tokenizer, max_tokens=5)[0]
    assert len(cut.ids) == 5 and cut.targets[-1] == -100


DATA = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "The sky is", "completion": " blue"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


def write_data(path):
    path.write_text("\n".join(json.dumps(x) for x in DATA) + "\n")
    return path


def test_a_run_resumed_from_its_checkpoint_ends_where_one_run_ends(tmp_path):
    """6 steps at once, and 4 steps (with activation checkpointing) then a rerun to 6 from checkpoint-4: the same
    adapter, bit for bit. Ctrl-C
    leaves a checkpoint of the steps done; a loss that is not finite stops with the last checkpoint named."""
    llm = npqwen.load("tiny")
    examples = ft.read_examples(write_data(tmp_path / "data.jsonl"), llm.tokenizer)
    run = dict(r=4, alpha=8, lr=1e-2, accumulate=2, save_every=2)
    ft.finetune(llm.model, examples, tmp_path / "once", 6, **run)
    ft.finetune(llm.model, examples, tmp_path / "twice", 4, checkpoint_activations=True, **run)
    assert ft.latest_checkpoint(tmp_path / "twice").name == "checkpoint-4"
    losses = ft.finetune(llm.model, examples, tmp_path / "twice", 6, **run)
    assert len(losses) == 2
    a, b = (npqwen.load("tiny", lora={"x": tmp_path / d}).lora_adapter("x").weights for d in ("once", "twice"))
    assert all(np.array_equal(a[n], b[n]) for n in a)

    ft.finetune(llm.model, examples, tmp_path / "all", 2, targets=ft.TARGETS, **run)   # resumed with other targets:
    with pytest.raises(npqwen.NpqwenError, match="does not match this run's"):      # refused, not a part of it
        ft.finetune(llm.model, examples, tmp_path / "all", 4, **run)

    def interrupt(step, loss, tokens):
        if step == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        ft.finetune(llm.model, examples, tmp_path / "stopped", 6, progress=interrupt, **run)
    assert ft.latest_checkpoint(tmp_path / "stopped").name == "checkpoint-3"
    with pytest.raises(npqwen.NpqwenError, match=r"the loss is not finite at optimizer step \d+ .*; the adapter was "
                                                 r"not updated.*the last checkpoint is .*checkpoint-\d+"):
        ft.finetune(llm.model, examples, tmp_path / "nan", 6, **dict(run, lr=1e30, save_every=1))


def test_the_command_trains_and_generate_serves_the_adapter(tmp_path):
    from npqwen.cli import main

    data, out = write_data(tmp_path / "data.jsonl"), tmp_path / "adapter"
    assert main(["finetune", "--model", "tiny", "--data", str(data), "--out", str(out), "--lora-r", "4",
                 "--steps", "3", "--lr", "1e-2", "--lora-targets", "q_proj,down_proj"]) == 0
    assert (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["down_proj", "q_proj"]
    assert main(["finetune", "--model", "tiny", "--data", str(data), "--out", str(tmp_path / "x"),
                 "--lora-targets", "q_proj,qproj"]) == 1   # one line naming 'qproj' and the projections there are
    assert main(["generate", "--model", "tiny", "--lora", f"ft={out}", "-p", "hi", "--max-new-tokens", "3"]) == 0
    assert main(["finetune", "--model", "tiny", "--data", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 1


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3.5"])
def test_adapter_gradients_equal_finite_differences(name):
    """d loss / d every lora_A and lora_B (one element of each, at random) in float64, through Qwen3's seven
    projections and Qwen3.5's Gated DeltaNet ones (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj)."""
    from npqwen import grad, ops
    from npqwen.lora import LINEAR_ATTENTION

    llm, rng, eps = npqwen.load(name, dtype="float64"), np.random.default_rng(2), 1e-5
    targets = ft.TARGETS + LINEAR_ATTENTION
    adapter = ft.new_adapter(llm.model, r=2, alpha=4, targets=targets)
    for n, a in adapter.weights.items():
        a[...] = 0.3 * rng.standard_normal(a.shape)
    ex = ft.example([5, 17, 33, 2], [101, 7, 64, 250])
    ours = grad.gradients(llm.model, ex.ids, grad.loss(ex.targets), weights=False, lora=adapter).lora_grads
    assert set(ours) == set(adapter.weights)

    def loss():
        return ops.cross_entropy(llm.model.forward(ex.ids, lora=adapter), ex.targets)
    worst = []
    for n, a in adapter.weights.items():
        idx = tuple(int(rng.integers(s)) for s in a.shape)
        old = a[idx]
        a[idx] = old + eps
        up = loss()
        a[idx] = old - eps
        down = loss()
        a[idx] = old
        worst.append((abs((up - down) / (2 * eps) - ours[n][idx]) / np.abs(ours[n]).max(), n))
    worst.sort(reverse=True)
    print(f"{name}: {len(ours)} adapter weights; worst relative differences {worst[:2]}")
    assert worst[0][0] < 1e-6


@pytest.mark.parametrize("name, fmt", [("tiny", "int8"), ("tiny", "bfloat16"), ("tiny-qwen3.5", "int8"),
                                       ("tiny-moe", "int8")])
def test_a_lora_on_a_frozen_compact_base_trains_as_on_its_float32_twin(name, fmt):
    """QLoRA's way: the base stays int8 or bfloat16 (npqwen/weights.py), the gradient flows through it by
    d_x = d_y @ W widened a block at a time. Five steps against the same steps on the base's dequantized weights
    in float32 (the twin): each loss and the adapter after them within 1e-5 (both float32, the products blocked
    differently)."""
    from npqwen import grad
    from test_weights import dequantized_twin

    llm = npqwen.load(name, weights=fmt)
    twin = dequantized_twin(llm)
    data = examples(4, seed=3)
    for ex in data:
        ex.ids[:] %= llm.config.vocab_size
        ex.targets[ex.targets >= 0] %= llm.config.vocab_size
    runs = []
    for model in (llm.model, twin):
        adapter = ft.new_adapter(model, r=4, alpha=8, targets=ft.TARGETS, seed=0)
        rng = np.random.default_rng(1)
        for a in adapter.weights.values():   # B non-zero from the start: every path has a gradient at step 1
            a[...] = 0.1 * rng.standard_normal(a.shape)
        optimizer = ft.AdamW(adapter.weights, lr=5e-3)
        losses = [ft.train_step(model, adapter, ft.batches(data, 2, s), optimizer) for s in range(5)]
        runs.append((losses, adapter.weights))
    (losses, tuned), (want_losses, want_tuned) = runs
    print(f"{name} {fmt}: losses {np.round(losses, 6)}, float32 twin {np.round(want_losses, 6)}; adapter "
          f"{max(rel(tuned[n], want_tuned[n]) for n in tuned):.1e}")
    assert rel(losses, want_losses) < 1e-5 and max(rel(tuned[n], want_tuned[n]) for n in tuned) < 1e-5
    with pytest.raises(npqwen.NpqwenError, match="frozen"):   # a compact weight has no gradient of its own
        grad.gradients(llm, [1, 2, 3], grad.loss())


def test_qwen4_exp_adapter_gradients_through_its_compact_hyper_connections():
    """Qwen4-Exp in int8, its hyper-connections' projections and its experts compact too (a frozen base), an adapter
    on every projection and on each hyper-connection's three: the adapter's gradients equal those on the dequantized
    weights in float64 within 5e-5 relative (float32's own error here: the float32 twin is 1.0e-5 off, measured)."""
    from npqwen import grad
    from npqwen.lora import HYPER_CONNECTION, TARGETS
    from npqwen.weights import is_compact
    from test_weights import dequantized_twin

    llm = npqwen.load("tiny-qwen4-exp", weights="int8")
    mixes = [n for n in llm.weights if n.endswith(tuple(f"{t}.weight" for t in HYPER_CONNECTION))]
    assert len(mixes) == 4 * 2 * 3 + 2 and all(is_compact(llm.weights[n]) for n in mixes)
    twin = dequantized_twin(llm)
    wide = type(twin)(twin.config, {n: w.astype(np.float64) if isinstance(w, np.ndarray) else w   # (the PLE tables)
                                    for n, w in twin.weights.items()},
                      {n: w.astype(np.float64) for n, w in twin.fused.items()})
    ex = examples(1, seed=3)[0]
    ex.ids[:] %= llm.config.vocab_size
    ex.targets[ex.targets >= 0] %= llm.config.vocab_size
    got = {}
    for name, model in (("int8", llm.model), ("float64", wide)):
        adapter = ft.new_adapter(model, r=4, alpha=8, targets=TARGETS + HYPER_CONNECTION, seed=0)
        rng = np.random.default_rng(1)
        for a in adapter.weights.values():   # B non-zero: every path has a gradient
            a[...] = 0.1 * rng.standard_normal(a.shape)
        got[name] = grad.gradients(model, ex.ids, grad.loss(ex.targets), weights=False, lora=adapter).lora_grads
    worst = max((rel(got["int8"][n], got["float64"][n]), n) for n in got["float64"])
    print(f"{len(got['float64'])} adapter gradients; worst relative difference {worst[0]:.1e} ({worst[1]})")
    assert set(got["int8"]) == set(got["float64"]) and any("hyper_connection" in n for n in got["int8"])
    assert worst[0] < 5e-5
