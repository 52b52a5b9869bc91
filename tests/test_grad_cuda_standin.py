"""Gradients on the CUDA path: npqwen/grad.py's backward, attribution and LoRA finetuning with device="cuda" on
the strict CuPy stand-in (tests/strict_cupy.py, which refuses what real CuPy refuses) give the CPU's results
exactly, for the built-in tiny Qwen3, Qwen3-MoE, Qwen3.5 and Qwen4-Exp and a tiny Qwen3.5-MoE checkpoint.
(The stand-in computes with NumPy underneath, so equal here means no step left the device or took another way;
on a GPU float32 would differ by rounding.)"""
import json

import numpy as np
import pytest
import strict_cupy
from conftest import write_npqwen_checkpoint
from hybrid_checkpoints import hybrid_moe_config
from safetensors.numpy import load_file

import npqwen
from npqwen import attribution, finetune, grad
from npqwen.backend import to_numpy

IDS = np.array([5, 17, 33, 2, 101, 7, 64, 250, 3, 99], dtype=np.int64)
# Qwen3.5-MoE as small as the built-in tiny-qwen3.5: 3 Gated DeltaNet layers, 1 full attention, 8 experts + a shared one
QWEN3_5_MOE = hybrid_moe_config(vocab_size=300, hidden_size=16, head_dim=8, linear_key_head_dim=8)


@pytest.fixture(scope="module")
def qwen3_5_moe_dir(tmp_path_factory):
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), QWEN3_5_MOE)


def load_both(model: str, dtype: str, monkeypatch, qwen3_5_moe_dir):
    """The model on the CPU and on the stand-in's "cuda" (cupy installed for this test only)."""
    strict_cupy.install(monkeypatch)
    path = qwen3_5_moe_dir if model == "qwen3.5-moe" else model
    return npqwen.load(path, dtype=dtype), npqwen.load(path, device="cuda", dtype=dtype)


def max_diff(cpu: dict, cuda: dict) -> float:
    """max |cuda - cpu| over the arrays of two dicts with the same names, each array on its device."""
    assert cpu.keys() == cuda.keys() and cpu
    for name, a in cuda.items():
        assert isinstance(a, strict_cupy.ndarray) and not isinstance(cpu[name], strict_cupy.ndarray), name
    return max(float(np.abs(to_numpy(cuda[n]) - cpu[n]).max()) for n in cpu)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe", "tiny-qwen3.5", "qwen3.5-moe", "tiny-qwen4-exp"])
def test_gradients_on_the_cupy_stand_in_equal_the_cpu(model, monkeypatch, qwen3_5_moe_dir):
    """In float64 (float32: the finetune test below): the loss's gradient w.r.t. every weight and every activation
    (the embedding's output: the input's gradient), with and without activation checkpointing, and attribution's
    gradient x input of a log-probability and of a logit difference."""
    dtype = "float64"
    cpu, cuda = load_both(model, dtype, monkeypatch, qwen3_5_moe_dir)
    want = grad.gradients(cpu, IDS, grad.loss())
    for checkpoint in (False, True):
        strict_cupy.transfers.reset()
        got = grad.gradients(cuda, IDS, grad.loss(), checkpoint=checkpoint)
        moved = strict_cupy.transfers.to_host_bytes
        diff = max_diff(dict(want), dict(got))
        print(f"{model} {dtype} checkpoint={checkpoint}: {len(want)} gradients, max |cuda - cpu| = {diff:.1e}, "
              f"loss {got.value} vs {want.value}; {moved} bytes to the host")
        assert diff == 0 and got.value == want.value and "model.embed_tokens" in got
        assert moved < 2048   # the loss and the MoE layers' choices (loop bounds): no activation or gradient crossed
    for objective in (grad.log_prob(7), grad.logit_diff(7, 9)):
        want, got = (attribution.gradient_x_input(llm, IDS, objective) for llm in (cpu, cuda))
        diff = float(np.abs(got.per_layer - want.per_layer).max())
        print(f"{model} {dtype}: gradient x input of {objective.name}, max |cuda - cpu| = {diff:.1e}")
        assert diff == 0 and got.value == want.value


def test_integrated_gradients_and_patching_on_the_cupy_stand_in_equal_the_cpu(monkeypatch, qwen3_5_moe_dir):
    """attribution's other three on Qwen3-MoE (float64): integrated gradients (4 steps), attribution patching
    (gradients) and activation patching (forwards), clean against a corrupted prompt."""
    cpu, cuda = load_both("tiny-moe", "float64", monkeypatch, qwen3_5_moe_dir)
    corrupt, objective = [5, 17, 33, 2, 101, 8, 64, 250, 3, 99], grad.logit_diff(7, 9)
    runs = [(attribution.integrated_gradients(llm, IDS, objective, steps=4),
             attribution.attribution_patching(llm, IDS, corrupt, objective),
             attribution.activation_patching(llm, IDS, corrupt, objective)) for llm in (cpu, cuda)]
    for want, got, result in zip(*runs, ("per_token", "effect", "effect")):
        diff = float(np.abs(getattr(got, result) - getattr(want, result)).max())
        print(f"{type(want).__name__}: max |cuda - cpu| = {diff:.1e}")
        assert diff == 0


def test_a_lora_finetune_on_the_cupy_stand_in_equals_the_cpu(monkeypatch, qwen3_5_moe_dir, tmp_path):
    """finetune() with AdamW and activation checkpointing: two steps (a checkpoint saved after each), then a rerun
    that resumes from the last one for a third, on Qwen3.5-MoE (LoRA on the Gated DeltaNet, attention, shared
    expert and its gate): the stand-in's losses and saved adapter and AdamW moments are the CPU's."""
    models = load_both("qwen3.5-moe", "float32", monkeypatch, qwen3_5_moe_dir)
    examples = [finetune.example(IDS[:6], IDS[6:]), finetune.example(IDS[:4], IDS[4:8])]
    losses, saved = [], []
    for llm, out in zip(models, (tmp_path / "cpu", tmp_path / "cuda")):
        run = dict(r=4, lr=1e-2, accumulate=2, save_every=1, checkpoint_activations=True)
        losses.append(finetune.finetune(llm.model, examples, out, steps=2, **run)
                      + finetune.finetune(llm.model, examples, out, steps=3, **run))   # resumes at step 2
        state = np.load(out / "checkpoint-2" / "optimizer.npz")   # AdamW's moments after step 2; the adapter after 3
        saved.append({**{n: state[n] for n in state.files}, **load_file(out / "adapter_model.safetensors")})
    diff = max(float(np.abs(saved[1][n] - saved[0][n]).max()) for n in saved[0])
    print(f"losses cpu {losses[0]}, cuda {losses[1]}; {len(saved[0])} saved arrays, max |cuda - cpu| = {diff:.1e}")
    assert losses[0] == losses[1] and len(losses[0]) == 3 and saved[0].keys() == saved[1].keys() and diff == 0
    assert json.loads((tmp_path / "cuda" / "adapter_config.json").read_text())["r"] == 4


def test_every_name_and_keyword_used_exists_in_real_cupy(monkeypatch, qwen3_5_moe_dir):
    """What the runs above asked of cupy is real cupy; so it holds when run alone, a short run of its own: Qwen3-MoE's
    gradients (flatnonzero, nonzero, put_along_axis, add.at, ...) and a LoRA + AdamW step with checkpointing."""
    from test_cuda_standin import check_against, real_cupy

    cuda = load_both("tiny-moe", "float32", monkeypatch, qwen3_5_moe_dir)[1]
    grad.gradients(cuda, IDS, grad.log_prob(7))
    adapter = finetune.new_adapter(cuda.model, r=2)
    finetune.train_step(cuda.model, adapter, [finetune.example(IDS[:6], IDS[6:])], finetune.AdamW(adapter.weights),
                        checkpoint=True)
    used = dict(strict_cupy.used)
    assert {"cupy.flatnonzero", "cupy.nonzero", "cupy.put_along_axis", "cupy.add.at", "cupy.sqrt"} <= used.keys()
    problems = check_against(real_cupy(), used)
    assert not problems, "\n".join(problems)


def test_the_loss_takes_targets_on_the_device(monkeypatch, qwen3_5_moe_dir):
    """grad.loss(targets) with the targets already on the model's device (a cupy array, as a CUDA training loop
    holds them) gives the loss and the gradients of the same targets from the host, on tiny Qwen3 (float64)."""
    cuda = load_both("tiny", "float64", monkeypatch, qwen3_5_moe_dir)[1]
    targets = np.array([-100, -100, 33, 2, 101, 7, 64, -100, 3, 99], dtype=np.int64)
    want = grad.gradients(cuda, IDS, grad.loss(targets))
    got = grad.gradients(cuda, IDS, grad.loss(strict_cupy.asarray(targets)))
    diff = max(float(np.abs(to_numpy(got[n]) - to_numpy(want[n])).max()) for n in want)
    print(f"device targets: loss {got.value} vs host {want.value}, {len(want)} gradients, max |diff| = {diff:.1e}")
    assert got.value == want.value and got.keys() == want.keys() and diff == 0
