"""Fine-tuning a LoRA adapter without torch: forward, loss, backward, step, in a loop you can read.

    adapter = new_adapter(llm.model, r=16, alpha=32)
    examples = read_examples("data.jsonl", llm.tokenizer)
    optimizer = AdamW(adapter.weights, lr=1e-4)
    for step in range(steps):
        loss = train_step(llm.model, adapter, examples_of_this_step, optimizer)
    save_adapter(adapter, "out/")            # PEFT's files: PEFT loads them, npqwen serves them (--lora)

The base weights stay frozen; the adapter adds scale * B A x to each projection it targets (PEFT's
LoraLayer, npqwen/lora.py). Its gradients come from npqwen/grad.py: the forward with the adapter, keeping
its activations, the loss on the answer tokens only, then the backward, in which each adapted projection
also hands back d_A and d_B (lora.add_backward). AdamW updates A and B in place, as torch.optim.AdamW does.

An example is one JSON object per line: {"prompt": ..., "completion": ...} (the loss on the completion's
tokens) or {"messages": [...]} (chat messages through the chat template; the loss on the last assistant
message's tokens). Shapes: T tokens of an example, r the rank, in / out a projection's widths.
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import grad
from .backend import to_numpy, xp_of
from .checkpoint import save_safetensors
from .errors import NpqwenError
from .lora import LINEAR, TARGETS, Delta, LoraAdapter, fused_columns, layer_modules, model_modules

IGNORE = -100   # a target the loss skips (HF's ignore_index)


@dataclass
class Example:
    """One training sequence: its token ids and each row's target (the next token, or IGNORE)."""
    ids: np.ndarray       # (T,)
    targets: np.ndarray   # (T,) row t: token t + 1 where it is an answer token, else IGNORE


def example(prompt_ids, answer_ids) -> Example:
    """The prompt then the answer; the loss on the answer's tokens (each predicted by the row before it)."""
    ids = np.asarray(list(prompt_ids) + list(answer_ids), dtype=np.int64)
    targets = np.full(len(ids), IGNORE, dtype=np.int64)
    targets[len(prompt_ids) - 1:len(ids) - 1] = ids[len(prompt_ids):]
    return Example(ids, targets)


def read_examples(path, tokenizer, max_tokens: int | None = None, too_long: str = "cut") -> list[Example]:
    """Every line of a JSONL file as an Example; a bad line is one error that names it. An example longer than
    max_tokens is cut to it (too_long="cut") or refused ("refuse")."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise NpqwenError(f"--data {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise NpqwenError(f"{where}: not JSON ({e})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str) and isinstance(item.get("completion"), str):
            ex = example(tokenizer.encode(item["prompt"]), tokenizer.encode(item["completion"]))
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"] and \
                isinstance(item["messages"][-1], dict) and item["messages"][-1].get("role") == "assistant":
            messages = item["messages"]
            before = tokenizer.encode(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True))
            whole = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
            if whole[:len(before)] != before:
                raise NpqwenError(f"{where}: the chat template renders the last assistant message apart from what "
                                  f"comes before it; end the messages with a plain assistant answer")
            ex = example(before, whole[len(before):])
        else:
            raise NpqwenError(f"{where}: an example is {{\"prompt\": str, \"completion\": str}} or {{\"messages\": "
                              f"[..., {{\"role\": \"assistant\", \"content\": ...}}]}}")
        if max_tokens is not None and len(ex.ids) > max_tokens:
            if too_long == "refuse":
                raise NpqwenError(f"{where}: {len(ex.ids)} tokens, more than --max-tokens {max_tokens}; shorten it, "
                                  f"or cut long examples with --too-long cut")
            ex = Example(ex.ids[:max_tokens], np.append(ex.targets[:max_tokens - 1], IGNORE))
        if (ex.targets != IGNORE).sum() == 0:
            raise NpqwenError(f"{where}: no answer token to learn from (an empty answer, or cut away by --max-tokens)")
        examples.append(ex)
    if not examples:
        raise NpqwenError(f"--data {path}: no examples (the file is empty)")
    return examples


# PEFT's default targets (LoraConfig's target_modules=None: its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
# for the model types npqwen reads that it has an entry for; tests/test_finetune.py checks them against PEFT's
PEFT_TARGETS = {"qwen2": ("q_proj", "v_proj"), "qwen3": ("q_proj", "v_proj")}


def default_targets(config) -> tuple[str, ...]:
    """PEFT's default for the model type: q_proj and v_proj on Qwen2 and Qwen3 (and Qwen3-VL's text model, which
    npqwen reads as the Qwen3 it is). PEFT has none for Qwen3-MoE, Qwen3.5, Qwen3-Next or Qwen4-Exp (it asks for
    target_modules), so there npqwen's: lora.TARGETS, attention's four and the MLP's three (on a MoE layer its
    shared expert's: Qwen4-Exp's q/k/v/o and shared expert)."""
    return PEFT_TARGETS.get(config.model_type, TARGETS)


def new_adapter(model, r: int = 16, alpha: float = 32, targets=None, seed: int = 0) -> LoraAdapter:
    """A fresh adapter on every decoder layer's projections named in `targets` (default: default_targets, PEFT's;
    Qwen4-Exp: and the final mixing's, outside the layers, as PEFT's names match it too), initialised as PEFT does:
    A (r, in) uniform in +-1/sqrt(in) (kaiming_uniform with a = sqrt(5)), B (out, r) zeros, scale alpha / r."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise NpqwenError(f"the LoRA rank must be an integer >= 1, got {r!r}")
    rng, cfg = np.random.default_rng(seed), model.config
    targets = default_targets(cfg) if targets is None else targets
    if unknown := sorted(set(targets) - set(LINEAR)):
        raise NpqwenError(f"LoRA targets {unknown} are not projections of a Qwen model; use some of "
                          f"{', '.join(LINEAR)}")
    adapter = LoraAdapter("finetune", Path("."), r, key="finetune")
    where = [(i, f"model.layers.{i}.{m}") for i in range(cfg.num_hidden_layers) for m in layer_modules(cfg, i)]
    for i, module in where + [(None, m) for m in model_modules(cfg)]:   # (layer or None, the module's HF name)
        parent, t = module.rsplit(".", 1)
        if t not in targets:
            continue
        out, in_ = model.weights[f"{module}.weight"].shape
        A = model.xp.asarray(rng.uniform(-1, 1, (r, in_)) / math.sqrt(in_)).astype(model.dtype)   # (r, in)
        B = model.xp.zeros((out, r), dtype=model.dtype)                                           # (out, r)
        adapter.weights[f"{module}.lora_A.weight"], adapter.weights[f"{module}.lora_B.weight"] = A, B
        kind = parent if i is None else parent.removeprefix(f"model.layers.{i}.")   # self_attn; the mixer's whole name
        matrix, cols = fused_columns(model, i, kind, t)
        adapter.deltas.setdefault(matrix, []).append(Delta(module, cols, A, B, alpha / r))
    return adapter


def save_adapter(adapter: LoraAdapter, directory, base: str = ""):
    """PEFT's two files: adapter_config.json and adapter_model.safetensors (names under base_model.model.)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    scale = next(d.scale for ds in adapter.deltas.values() for d in ds)          # alpha / r, the same for every module
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=adapter.r, lora_alpha=scale * adapter.r,
                  target_modules=sorted({m.rsplit(".", 1)[-1] for m in adapter.modules}), lora_dropout=0.0,
                  bias="none", use_rslora=False, base_model_name_or_path=base, inference_mode=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(directory / "adapter_model.safetensors",
                     {f"base_model.model.{name}": to_numpy(a).astype(np.float32) for name, a in adapter.weights.items()})


class AdamW:
    """torch.optim.AdamW's update, step for step: decoupled weight decay, then Adam with bias correction."""

    def __init__(self, params: dict, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        self.params, self.lr, self.betas, self.eps, self.weight_decay = params, lr, betas, eps, weight_decay
        self.m = {n: xp_of(p).zeros_like(p) for n, p in params.items()}   # first moments, on the weights' device
        self.v = {n: xp_of(p).zeros_like(p) for n, p in params.items()}   # second moments
        self.t = 0

    def step(self, grads: dict):
        """Update every parameter in place from its gradient; one with none is not touched, as torch skips a
        parameter whose .grad is None (Qwen4-Exp's QSA indexer: its choice has no gradient)."""
        self.t += 1
        b1, b2 = self.betas
        correction1, correction2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for name, p in self.params.items():
            if name not in grads:
                continue
            g, m, v = grads[name], self.m[name], self.v[name]
            p *= 1 - self.lr * self.weight_decay                     # decoupled weight decay
            m *= b1
            m += (1 - b1) * g                                        # m = b1 m + (1 - b1) g
            v *= b2
            v += (1 - b2) * g * g                                    # v = b2 v + (1 - b2) g^2
            p -= (self.lr / correction1) * m / (xp_of(v).sqrt(v) / math.sqrt(correction2) + self.eps)


def train_step(model, adapter: LoraAdapter, examples: list[Example], optimizer: AdamW,
               checkpoint: bool = False) -> float:
    """One optimizer step over `examples` (gradient accumulation: their gradients averaged): the mean loss.
    checkpoint=True: activation checkpointing (grad.gradients), less memory for one more forward's work."""
    total, losses = {}, []   # each weight's mean gradient over the examples (none: a weight no path reaches)
    for ex in examples:
        # forward with the adapter, the loss on the answer tokens, backward (npqwen/grad.py)
        try:
            g = grad.gradients(model, ex.ids, grad.loss(ex.targets), weights=False, lora=adapter,
                               activations=False, checkpoint=checkpoint)
        except grad.NotFinite as e:   # a loss of nan or inf: nothing to step with
            raise NpqwenError(f"the loss is not finite at optimizer step {optimizer.t + 1} ({e}); the adapter was "
                              f"not updated (lower --lr, or check the data)") from None
        losses.append(g.value)
        for name, d in g.lora_grads.items():
            total[name] = total.get(name, 0) + d / len(examples)
    loss = float(np.mean(losses))
    if not all(math.isfinite(float(xp_of(d).abs(d).max())) for d in total.values()):
        raise NpqwenError(f"the gradient is not finite at optimizer step {optimizer.t + 1} (loss {loss}); the adapter "
                          f"was not updated (lower --lr, or check the data)")
    optimizer.step(total)
    return loss


def batches(examples: list[Example], accumulate: int, step: int) -> list[Example]:
    """The examples of optimizer step `step` (from 0): the next `accumulate` of them, round the data in order."""
    return [examples[(step * accumulate + j) % len(examples)] for j in range(accumulate)]


def save_checkpoint(directory, adapter: LoraAdapter, optimizer: AdamW):
    """The adapter (PEFT's files) and AdamW's moments and step count: what a rerun resumes from."""
    save_adapter(adapter, directory)
    np.savez(Path(directory) / "optimizer.npz", t=optimizer.t,                  # the moments copied to the host
             **{f"m/{n}": to_numpy(a) for n, a in optimizer.m.items()},
             **{f"v/{n}": to_numpy(a) for n, a in optimizer.v.items()})


def latest_checkpoint(out) -> Path | None:
    """OUT/checkpoint-N with the largest N that has all its files, or None."""
    found = [(int(p.name.rsplit("-", 1)[1]), p) for p in Path(out).glob("checkpoint-*")
             if p.name.rsplit("-", 1)[1].isdigit() and (p / "optimizer.npz").is_file()]
    return max(found)[1] if found else None


def resume(model, directory, adapter: LoraAdapter, optimizer: AdamW):
    """Load a checkpoint's adapter weights and AdamW state into `adapter` and `optimizer`, in place."""
    from .lora import read_adapter

    saved = read_adapter(directory, "checkpoint", model)
    for name, a in adapter.weights.items():
        if saved.weights.keys() != adapter.weights.keys() or saved.weights[name].shape != a.shape:
            raise NpqwenError(f"{directory}: its adapter does not match this run's (--lora-r, targets, model); "
                              f"use another --out, or the options it was made with")
        a[...] = saved.weights[name]
    state = np.load(Path(directory) / "optimizer.npz")
    optimizer.t = int(state["t"])
    for name in adapter.weights:   # the saved moments (host arrays) onto the weights' device
        m, v = optimizer.m[name], optimizer.v[name]
        m[...], v[...] = xp_of(m).asarray(state[f"m/{name}"]), xp_of(v).asarray(state[f"v/{name}"])


def finetune(model, examples: list[Example], out, steps: int, r: int = 16, alpha: float = 32, lr: float = 1e-4,
             accumulate: int = 1, save_every: int = 0, seed: int = 0, progress=None,
             checkpoint_activations: bool = False, targets=None) -> list[float]:
    """The training loop: for each step, forward, loss, backward, AdamW step; a checkpoint every `save_every`
    steps in OUT/checkpoint-N (a rerun with the same OUT resumes from the latest), the adapter in OUT at the end.
    A loss that is not finite stops the run (the last checkpoint stays); Ctrl-C saves one first. The adapter is on
    `targets` (new_adapter's default: PEFT's). The losses."""
    adapter = new_adapter(model, r, alpha, targets, seed)
    optimizer = AdamW(adapter.weights, lr=lr)
    last = latest_checkpoint(out)
    if last is not None:
        resume(model, last, adapter, optimizer)
    losses = []
    try:
        for step in range(optimizer.t, steps):
            batch = batches(examples, accumulate, step)
            losses.append(train_step(model, adapter, batch, optimizer, checkpoint_activations))   # forward .. step
            if progress is not None:
                progress(step + 1, losses[-1], sum(len(ex.ids) for ex in batch))
            if save_every and (step + 1) % save_every == 0:
                save_checkpoint(Path(out) / f"checkpoint-{step + 1}", adapter, optimizer)
    except KeyboardInterrupt:
        save_checkpoint(Path(out) / f"checkpoint-{optimizer.t}", adapter, optimizer)
        raise
    except NpqwenError as e:
        kept = latest_checkpoint(out)
        raise NpqwenError(f"{e}; the last checkpoint is {kept}" if kept else f"{e}; no checkpoint was saved") from None
    save_adapter(adapter, out)
    return losses
