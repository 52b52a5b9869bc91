"""npqwen vs HF transformers, module by module, on the same input (`npqwen compare`).

Needs torch and transformers (the test extra); npqwen itself never imports them. HF runs in
float32 with eager attention and forward hooks on every module; npqwen runs with a Trace
recorder; each step's max |difference| is reported, and the first one past the tolerance
(relative to the size of HF's values, at least 1) is the place to look.

Qwen4-Exp's steps are its modules' outputs too: each layer's PLE, the hyper-connections' mixed inputs (their first
output), the QSA indexer's selection mask, the hyper-connection mixer; the C streams after attention are
mlp_hyper_connection's argument.
"""
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import NpqwenError
from .trace import Trace


def require_torch():
    """Fail early, before the model loads, when torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        # A bare `pip install torch` can pull a multi-GB CUDA build: pin the version the tests use.
        raise NpqwenError(f"npqwen compare needs torch and transformers: pip install torch==2.13.0 transformers "
                          f"(or, in a checkout, pip install torch==2.13.0 && pip install -e '.[test]'); here: {e}"
                          ) from None


@contextlib.contextmanager
def no_progress_bars():
    """Inside, transformers draws no "Loading weights" bar on stderr (the report is the output)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


# config.json's model_type -> the transformers class that reads the checkpoint
HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
              "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
              "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_next": "Qwen3NextForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen4_exp_text": "Qwen4ExpForCausalLM",
              "qwen4_exp": "Qwen4ExpForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
              "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}


def hf_model(path: Path):
    """transformers' model of the checkpoint at `path`, in float32 with eager attention (its probabilities)."""
    import torch
    import transformers

    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type", "qwen3")
    model_class = getattr(transformers, HF_CLASSES.get(model_type, "Qwen3ForCausalLM"), None)
    if model_class is None:
        raise NpqwenError(f"this transformers ({transformers.__version__}) has no {HF_CLASSES[model_type]} for "
                          f"model_type {model_type!r}: npqwen compare needs a transformers that has it "
                          f"(pip install -U transformers)")
    return model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def rows(pick):
    """A pick for a module HF runs on (T, ...) rows without the batch axis: the batch axis added back."""
    return lambda a, k, o: pick(a, k, o)[None]


def hf_reference(llm, ids) -> dict:
    """HF transformers' intermediate arrays for `ids`, under npqwen's trace names."""
    require_torch()
    import torch

    with tempfile.TemporaryDirectory() as tmp, no_progress_bars():
        # a GGUF file (or a model made in memory): its weights saved widened to float32, for HF to read
        path = llm.path if llm.path is not None and Path(llm.path).is_dir() else llm.save(Path(tmp) / "model")
        hf = hf_model(path)
    refs, hooks = {}, []

    def keep(name, pick):
        def hook(module, args, kwargs, output):
            refs[name] = pick(args, kwargs, output)
        return hook

    def out(args, kwargs, output):
        return output[0] if isinstance(output, tuple) else output

    def arg(args, kwargs, output):
        return args[0]

    def on(module, name, pick=out):
        hooks.append(module.register_forward_hook(keep(name, pick), with_kwargs=True))

    m = getattr(hf.model, "language_model", hf.model)   # Qwen3.5's hub layout: the text model inside
    on(m.embed_tokens, "model.embed_tokens")
    on(m.rotary_emb, "model.rotary_emb.cos", lambda a, k, o: o[0])
    on(m.rotary_emb, "model.rotary_emb.sin", lambda a, k, o: o[1])
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}"
        on(layer, p)
        if llm.config.qwen4_exp:   # PLE first on some layers, then each block's input mixed from the C streams
            if layer.ple is not None:
                on(layer.ple, f"{p}.ple")                                          # (1, T, C*D)
            on(layer.attn_hyper_connection, f"{p}.attn_hyper_connection")          # (mixed, streams, weights)[0]
            on(layer.mlp_hyper_connection, f"{p}.attn_residual", arg)              # the streams after attention
            on(layer.mlp_hyper_connection, f"{p}.mlp_hyper_connection")
            if hasattr(layer, "self_attn"):   # QSA: the indexer's selection (1, 1, T, S) bool
                on(layer.self_attn.indexer, f"{p}.self_attn.indexer")
        else:
            on(layer, f"{p}.input", lambda a, k, o: a[0] if a else k["hidden_states"])
            on(layer.input_layernorm, f"{p}.input_layernorm")
        if hasattr(layer, "linear_attn"):   # Qwen3.5 / Qwen3-Next: Gated DeltaNet, its modules by their HF names
            attn = layer.linear_attn
            for part, module in attn.named_children():
                if isinstance(module, torch.nn.Linear):
                    on(module, f"{p}.linear_attn.{part}")
            on(attn.norm, f"{p}.linear_attn.core_attn_out", rows(arg))   # the delta rule's output, (T*Hv, dv)
            on(attn.norm, f"{p}.linear_attn.norm", rows(out))
            on(attn, f"{p}.mixer")
        else:
            attn = layer.self_attn
            norms = ("q_norm", "k_norm") if llm.config.qk_norm else ()   # Qwen2 has no QK-norm
            for part in ("q_proj", "k_proj", "v_proj", *norms, "o_proj"):
                on(getattr(attn, part), f"{p}.self_attn.{part}")
            on(attn.o_proj, f"{p}.self_attn.attn_output", arg)
            on(attn, f"{p}.mixer", lambda a, k, o: o[0])
            on(attn, f"{p}.self_attn.attn_probs", lambda a, k, o: o[1])
        if not llm.config.qwen4_exp:
            on(layer.post_attention_layernorm, f"{p}.post_attention_layernorm")
        mlp = layer.mlp
        if hasattr(mlp, "experts"):   # the sparse layer, on (T, D) rows: a batch axis added back
            for j, name in enumerate(("gate", "gate.top_k_weights", "gate.top_k_index")):   # (logits, weights, index)
                on(mlp.gate, f"{p}.mlp.{name}", lambda a, k, o, j=j: o[j][None])
            on(mlp.experts, f"{p}.mlp.experts", rows(out))
            if hasattr(mlp, "shared_expert"):   # Qwen3.5-MoE / Qwen3-Next: a shared expert and its gate
                on(mlp.shared_expert_gate, f"{p}.mlp.shared_expert_gate", rows(out))
                for part in ("gate_proj", "up_proj", "act_fn", "down_proj"):
                    on(getattr(mlp.shared_expert, part), f"{p}.mlp.shared_expert.{part}", rows(out))
            continue
        for part in ("gate_proj", "up_proj", "act_fn", "down_proj"):
            on(getattr(mlp, part), f"{p}.mlp.{part}")
    if llm.config.qwen4_exp:   # the C streams mixed into one, in the final norm's place
        on(m.hyper_connection_mixer, "model.hyper_connection_mixer")
    else:
        on(m.norm, "model.norm")
    on(hf.lm_head, "lm_head")
    with torch.no_grad():
        hf(torch.tensor([list(ids)]))
        for i, layer in enumerate(m.layers):
            p = f"model.layers.{i}"
            mixer = refs.pop(f"{p}.mixer")
            if not llm.config.qwen4_exp:   # (Qwen4-Exp's: mlp_hyper_connection's argument, hooked above)
                refs[f"{p}.attn_residual"] = refs.pop(f"{p}.input") + mixer
            if not hasattr(layer, "self_attn"):
                continue
            # Steps HF has no module for, computed from what the hooks saw with HF's own functions.
            rope = sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb   # (Qwen3.5's: partial)
            q, k = (refs[f"{p}.self_attn.{n}"] for n in (("q_norm", "k_norm") if llm.config.qk_norm else
                                                          ("q_proj", "k_proj")))     # Qwen2: RoPE turns q_proj's q
            if not llm.config.qk_norm:   # (T, H*Dh) -> (1, T, H, Dh), as q_norm's output is shaped
                q, k = (a.view(1, len(ids), -1, llm.config.head_dim) for a in (q, k))
            cos, sin = refs["model.rotary_emb.cos"], refs["model.rotary_emb.sin"]
            q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            refs[f"{p}.self_attn.q_rope"], refs[f"{p}.self_attn.k_rope"] = q.transpose(1, 2), k.transpose(1, 2)
            if llm.config.hybrid:   # o_proj reads the output after Qwen3.5's gate; npqwen's attn_output is before it
                probs, v = refs[f"{p}.self_attn.attn_probs"], refs[f"{p}.self_attn.v_proj"]     # (1, H, T, T)
                v = v.view(1, len(ids), -1, llm.config.head_dim).transpose(1, 2)                # (1, K, T, Dh)
                v = v.repeat_interleave(probs.shape[1] // v.shape[1], dim=1)                    # (1, H, T, Dh)
                refs[f"{p}.self_attn.attn_output"] = (probs @ v).transpose(1, 2).reshape(1, len(ids), -1)
    for h in hooks:
        h.remove()
    return {name: t[0].detach().numpy() if t.dim() > 1 else t.detach().numpy() for name, t in refs.items()}


def compare(llm, ids, tol: float = 1e-3) -> list[dict]:
    """One row per traced step: name, max |npqwen - HF|, max |HF|, and whether it is within tol."""
    trace = Trace()
    llm.forward(ids, recorder=trace)
    refs = hf_reference(llm, ids)
    rows = []
    for name, ours in trace.items():
        if name not in refs:
            continue
        want = refs[name].reshape(ours.shape)
        diff = float(np.abs(ours.astype(np.float64) - want).max())
        scale = float(np.abs(want).max())
        rows.append({"name": name, "max_abs_diff": diff, "max_abs_hf": scale,
                     "ok": diff <= tol * max(1.0, scale)})
    return rows


def relative(row: dict) -> float:
    """What the tolerance is checked against: max |diff| over max |HF|, that at least 1."""
    return row["max_abs_diff"] / max(1.0, row["max_abs_hf"])


def report(rows, tol: float) -> str:
    width = max(len(r["name"]) for r in rows)
    lines = [f"{'module':<{width}}  {'max |diff|':>11}  {'max |HF|':>10}  {'relative':>10}"]
    first = next((r for r in rows if not r["ok"]), None)
    for r in rows:
        mark = "   <-- first past the tolerance" if r is first else ("   past" if not r["ok"] else "")
        lines.append(f"{r['name']:<{width}}  {r['max_abs_diff']:>11.3e}  {r['max_abs_hf']:>10.3e}  "
                     f"{relative(r):>10.3e}{mark}")
    if first is None:
        largest = max(rows, key=lambda r: r["max_abs_diff"])
        worst = max(rows, key=relative)
        lines.append(f"\nall {len(rows)} steps within {tol:g} (relative: max |diff| / max |HF|, that at least 1); "
                     f"largest max |diff| {largest['max_abs_diff']:.3e} at {largest['name']}; largest relative "
                     f"difference {relative(worst):.3e} at {worst['name']}")
    else:
        lines.append(f"\nfirst step past {tol:g}: {first['name']} (max |diff| {first['max_abs_diff']:.3e}, "
                     f"relative {relative(first):.3e})")
    return "\n".join(lines)
