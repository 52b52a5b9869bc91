"""LoRA adapters, as PEFT writes them: W x + scale * B (A x), added to the rows of the requests that ask.

A LoRA adapter of rank r keeps the base weight W (out, in) frozen and learns two thin matrices,
A (r, in) and B (out, r); the layer computes W x + scale * B A x (PEFT's `LoraLayer`), with
scale = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). npqwen never touches W: each linear layer
runs once over every row of the batch, then each adapter adds its update to its own rows, grouped
by adapter as Punica and S-LoRA do (`add`). So one batch serves many adapters and the base model at
once; `merge` folds one adapter into W instead (`npqwen merge-lora`).

PEFT's files: `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, rank_pattern,
alpha_pattern) and `adapter_model.safetensors`, whose names are the base model's module names under
`base_model.model.` with `.lora_A.weight` (r, in) or `.lora_B.weight` (out, r). npqwen applies
adapters on the linear layers of a decoder layer (`layer_modules`): Qwen3's seven; in a hybrid model
(Qwen3.5, Qwen3-Next) a linear-attention layer's Gated DeltaNet projections in place of self_attn's;
in a MoE layer the shared expert's (Qwen3.5-MoE, Qwen3-Next) in place of one MLP; in Qwen4-Exp also the QSA
indexer's projection, the hyper-connections' (each layer's two gated residuals and the final mixing, outside the
layers) and the Per-Layer Embeddings' two, which is every linear layer PEFT's all-linear adapts there. Whatever else a
file holds (DoRA, modules_to_save, embedding or lm_head adapters, MoE experts) is refused, with why.

Shapes: T rows of a batch, n of them one adapter's, r rank, in / out a projection's widths.
"""
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .checkpoint import read_safetensors_header, read_tensor
from .errors import NpqwenError
from .weights import is_compact

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP                                  # every linear layer of a Qwen3 decoder layer
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")   # Qwen3.5's Gated DeltaNet
LINEAR_ATTENTION_NEXT = ("in_proj_qkvz", "in_proj_ba", "out_proj")                     # Qwen3-Next's (grouped rows)
HYPER_CONNECTION = ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")   # Qwen4-Exp's mixing
QWEN4_EXP = HYPER_CONNECTION + ("index_qk_proj", "key_proj", "value_proj")   # ... its QSA indexer's, its PLE's two
LINEAR = TARGETS + LINEAR_ATTENTION + ("in_proj_qkvz", "in_proj_ba", "shared_expert_gate") + QWEN4_EXP   # every name
MIXER = "model.hyper_connection_mixer"                      # Qwen4-Exp's final mixing of the streams: in no layer
WEIGHT = re.compile(r"^base_model\.model\.(.+)\.(lora_A|lora_B)\.weight$")
MODULE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")        # model.layers.3.linear_attn.in_proj_qkv
_loads = itertools.count()                                 # each load its own prefix-cache key


class Delta(NamedTuple):
    """One module's update, placed in the output of the matrix the model multiplies by."""
    module: str    # PEFT's module name: model.layers.3.self_attn.k_proj
    cols: slice    # its columns of the fused output (qkv_proj: q | k | v; gate_up_proj: gate | up)
    A: object      # (r, in)
    B: object      # (out, r)
    scale: float   # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA


@dataclass(eq=False)
class LoraAdapter:
    """A loaded adapter: its updates by the model matrix they add to, and PEFT's arrays by name."""
    name: str
    path: Path
    r: int                                     # the config's rank (rank_pattern may give modules others)
    deltas: dict = field(default_factory=dict)   # model matrix (model.layers.3.self_attn.qkv_proj) -> [Delta]
    weights: dict = field(default_factory=dict)  # model.layers.3.self_attn.q_proj.lora_A.weight -> array
    key: str = ""                                # the prefix cache's key: unique to this load

    @property
    def modules(self) -> list[str]:
        return [d.module for ds in self.deltas.values() for d in ds]


def add(out, x, groups, matrix: str):
    """out (T, out) of one linear layer over the whole batch, plus each adapter's update on its own
    rows: scale * (x_rows @ A.T) @ B.T (PEFT's LoraLayer), one adapter's rows at a time (Punica, S-LoRA)."""
    for adapter, rows in groups:
        for d in adapter.deltas.get(matrix, ()):
            out[rows, d.cols] += d.scale * (x[rows] @ d.A.T) @ d.B.T     # (n, in) @ (in, r) @ (r, out) -> (n, out)
    return out


def add_backward(d_out, x, adapter, matrix: str):
    """Backward of `add` for one adapter on every row (training): out += scale * (x A^T) B^T, so with
    u = x A^T (T, r): d_B = scale * d_out^T u (out, r), d_u = scale * d_out B, d_A = d_u^T x (r, in), and x gets
    d_u A. Returns d_x (T, in) of the adapter's path (0 when it adapts nothing here) and {weight name: gradient}
    under the adapter's own names (model.layers.3.self_attn.q_proj.lora_A.weight)."""
    d_x, grads = 0.0, {}
    for d in adapter.deltas.get(matrix, ()):
        d_cols = d_out[:, d.cols]                                        # (T, out) this module's columns
        u = x @ d.A.T                                                    # (T, r)
        grads[f"{d.module}.lora_B.weight"] = d.scale * (d_cols.T @ u)    # (out, r)
        d_u = d.scale * (d_cols @ d.B)                                   # (T, r)
        grads[f"{d.module}.lora_A.weight"] = d_u.T @ x                   # (r, in)
        d_x = d_x + d_u @ d.A                                            # (T, in)
    return d_x, grads


def row_groups(loras, rows, T: int, xp) -> list:
    """(adapter, its rows) for each adapter in a batch: `loras` has one adapter (or None) per sequence,
    `rows` (first row, n) per sequence. All T rows of one adapter are a slice, not an index array."""
    by_adapter = {}
    for (first, n), adapter in zip(rows, loras or ()):
        if adapter is not None:
            by_adapter.setdefault(id(adapter), (adapter, []))[1].extend(range(first, first + n))
    return [(a, slice(None) if len(r) == T else xp.asarray(np.array(r, dtype=np.int64)))
            for a, r in by_adapter.values()]


def output_groups(loras, rows, output_rows, xp) -> list:
    """row_groups for the B rows a model's last step runs on, `output_rows` (B,) of the batch's T (Qwen4-Exp's final
    mixing, which runs after the rows that have no output are dropped): (adapter, its rows among the B)."""
    owner = np.full(max((first + n for first, n in rows), default=0), -1)    # (T,) each row's sequence
    for k, (first, n) in enumerate(rows):
        owner[first:first + n] = k
    by_adapter = {}
    for b, k in enumerate(owner[np.asarray(output_rows, dtype=np.int64)]):
        adapter = loras[k] if loras else None
        if adapter is not None:
            by_adapter.setdefault(id(adapter), (adapter, []))[1].append(b)
    return [(a, slice(None) if len(r) == len(output_rows) else xp.asarray(np.array(r, dtype=np.int64)))
            for a, r in by_adapter.values()]


def merge(weights: dict, adapter: LoraAdapter):
    """Fold the adapter into the base weights in place: W += scale * B @ A (PEFT's merge_and_unload)."""
    if any(is_compact(weights[f"{d.module}.weight"]) for ds in adapter.deltas.values() for d in ds):
        raise NpqwenError("an adapter is merged into float32 weights, and these are compact (npqwen/weights.py); "
                          "load the base with weights='float32' (--weights float32) to merge")
    for ds in adapter.deltas.values():
        for d in ds:
            weights[f"{d.module}.weight"] += d.scale * (d.B @ d.A)          # (out, r) @ (r, in) -> (out, in)


def layer_modules(config, i: int) -> list[str]:
    """The linear layers of decoder layer i an adapter reaches, named under model.layers.{i}: self_attn's four, or
    in a hybrid's linear-attention layer its Gated DeltaNet's; the MLP's three, or in a MoE layer its shared
    expert's and the shared expert's gate (Qwen3.5-MoE, Qwen3-Next; Qwen3-MoE has none: its experts are refused)."""
    if config.is_linear_layer(i):
        attn = [f"linear_attn.{t}" for t in (LINEAR_ATTENTION_NEXT if config.qwen3_next else LINEAR_ATTENTION)]
    else:
        attn = [f"self_attn.{t}" for t in ATTENTION]
    if config.qwen4_exp:   # [PLE's two], the mixing before attention, [the indexer], attention, the mixing before MLP
        ple = ["ple.key_proj", "ple.value_proj"] if config.is_ple_layer(i) else []
        indexer = [] if config.is_linear_layer(i) else ["self_attn.indexer.index_qk_proj"]
        attn = (ple + [f"attn_hyper_connection.{t}" for t in HYPER_CONNECTION] + indexer + attn
                + [f"mlp_hyper_connection.{t}" for t in HYPER_CONNECTION])
    if not config.is_moe_layer(i):
        return attn + [f"mlp.{t}" for t in MLP]
    if config.shared_expert_intermediate_size:
        return attn + [f"mlp.shared_expert.{t}" for t in MLP] + ["mlp.shared_expert_gate"]
    return attn


def model_modules(config) -> list[str]:
    """The linear layers outside the decoder layers an adapter reaches: Qwen4-Exp's final mixing's two."""
    return [f"{MIXER}.{t}" for t in HYPER_CONNECTION[:2]] if config.qwen4_exp else []


def describe(config, i: int) -> str:
    """What decoder layer i is, in words, for an error."""
    kind = "a linear-attention (Gated DeltaNet) layer" if config.is_linear_layer(i) else "a full-attention layer"
    return kind + (" whose MLP is a mixture of experts" if config.is_moe_layer(i) else "")


def text_model(name: str) -> str:
    """A module name of Qwen3.5's hub layout (model.language_model.layers...) as npqwen names it (model.layers...)."""
    return name.replace("model.language_model.", "model.", 1) if name.startswith("model.language_model.") else name


def fused_columns(model, layer: int | None, kind: str, name: str) -> tuple[str, slice]:
    """The model matrix a PEFT module's output is part of, and its columns there (npqwen fuses q, k, v
    into qkv_proj and gate, up into gate_up_proj; o_proj, down_proj and the linear-attention ones stand alone).
    layer None: a module outside the layers, `kind` its whole parent (model.hyper_connection_mixer)."""
    W = model.weights
    p = f"model.layers.{layer}.{kind}" if layer is not None else kind
    if name in ("q_proj", "k_proj", "v_proj"):
        q, k = W[f"{p}.q_proj.weight"].shape[0], W[f"{p}.k_proj.weight"].shape[0]
        start = {"q_proj": 0, "k_proj": q, "v_proj": q + k}[name]
        width = W[f"{p}.{name}.weight"].shape[0]
        return f"{p}.qkv_proj", slice(start, start + width)
    if name in ("gate_proj", "up_proj"):
        F = W[f"{p}.gate_proj.weight"].shape[0]
        return f"{p}.gate_up_proj", slice(0, F) if name == "gate_proj" else slice(F, 2 * F)
    return f"{p}.{name}", slice(None)


def pattern_value(patterns: dict, module: str, default):
    """rank_pattern / alpha_pattern as PEFT reads them: the first key that matches the end of the
    module's name, as a regular expression (peft.utils.other.get_pattern_key)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def names(spec, module: str) -> bool:
    """Whether a PEFT module list names this module: a list of names (the end of the module's name),
    "all-linear", or a regular expression over the whole name."""
    if spec == "all-linear":
        return module.rsplit(".", 1)[-1] in LINEAR
    if isinstance(spec, str):
        return re.fullmatch(spec, module) is not None
    return any(module == t or module.endswith("." + t) for t in spec or ())


def targeted(config: dict, layer: int, module: str) -> bool:
    """Whether PEFT adapted this module: named by target_modules, not by exclude_modules, and in one of
    layers_to_transform when that is given."""
    layers = config.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers
    return names(config["target_modules"], module) and not names(config.get("exclude_modules"), module) and (
        layers is None or layer in layers)


def read_config(path: Path) -> dict:
    """adapter_config.json, with what npqwen does not apply refused (which, and why)."""
    file = path / "adapter_config.json"
    if not file.is_file():
        raise NpqwenError(f"{path}: no adapter_config.json; a LoRA adapter is a directory PEFT's save_pretrained "
                          f"wrote (adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NpqwenError(f"{file}: cannot read it ({e})") from None
    if not isinstance(config, dict):
        raise NpqwenError(f"{file}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise NpqwenError(f"{file}: peft_type is {config['peft_type']!r}; npqwen applies LoRA adapters only")
    refused = [("use_dora", "DoRA rescales each column of W + B A by a learned magnitude, which npqwen does not "
                            "apply; merge it into the base with PEFT (merge_and_unload) and load the result"),
               ("modules_to_save", "it replaces whole modules (modules_to_save), which an adapter added to some rows "
                                   "of a batch cannot do; merge it with PEFT and load the result"),
               ("trainable_token_indices", "it trains rows of the embedding, which npqwen does not apply"),
               ("target_parameters", "it adapts parameters (MoE experts, a router: PEFT's all-linear does so on "
                                     "Qwen3-Next), which npqwen does not apply; name the linear layers in "
                                     "target_modules instead"),
               ("lora_bias", "it adds a bias to lora_B, which npqwen does not apply"),
               ("fan_in_fan_out", "its weights are stored transposed (Conv1D), which a Qwen3 never has")]
    for key, why in refused:
        if config.get(key):
            raise NpqwenError(f"{file}: {key} is set: {why}")
    if config.get("bias", "none") != "none":
        raise NpqwenError(f"{file}: bias is {config['bias']!r}: the adapter trains the base's biases, which npqwen "
                          f"does not apply; merge it with PEFT and load the result")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise NpqwenError(f"{file}: r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise NpqwenError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if targets is None or not isinstance(targets, (str, list)):
        raise NpqwenError(f"{file}: target_modules must be a list of module names or a regular expression, "
                          f"got {targets!r}")
    for t in targets if isinstance(targets, list) else []:
        if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in LINEAR:
            why = ("embedding and lm_head adapters are not applied" if t in ("embed_tokens", "lm_head")
                   else "it is not a linear layer of a decoder layer")
            raise NpqwenError(f"{file}: target_modules names {t!r}: {why}; npqwen applies adapters on "
                              f"{', '.join(LINEAR)}")
    return config


def refusal(name: str) -> str:
    """Why a tensor of an adapter file is not applied."""
    if "lora_magnitude_vector" in name:
        return "it is a DoRA magnitude, which npqwen does not apply"
    if "lora_embedding" in name or "embed_tokens" in name:
        return "it adapts the embedding, which npqwen does not apply"
    if "modules_to_save" in name:
        return "it replaces a whole module (modules_to_save), which npqwen does not apply"
    if "lm_head" in name:
        return "it adapts lm_head, which npqwen does not apply"
    if ".experts." in name:
        return ("it adapts a Qwen3-MoE expert, which npqwen does not apply (attention adapters of a MoE model are, "
                "and its shared expert's)")
    if ".visual." in name:
        return "it adapts the vision tower, which npqwen does not run (it reads the text model only)"
    return f"it is not a LoRA weight of a decoder layer's linear layers ({', '.join(LINEAR)})"


def order(config, module: str) -> tuple[int, int]:
    """A module's place in the forward pass: (layer, its place among the layer's linear layers); the final mixing's
    after the last layer."""
    if module in model_modules(config):
        return config.num_hidden_layers, model_modules(config).index(module)
    i, where = MODULE.match(module).groups()
    return int(i), layer_modules(config, int(i)).index(where)


def read_adapter(path, name: str, model) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter directory for `model` (any npqwen model): arrays in the model's dtype."""
    path = Path(path)
    if not path.is_dir():
        raise NpqwenError(f"LoRA adapter {name!r}: {path} is not a directory")
    config = read_config(path)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        bin_ = (path / "adapter_model.bin").is_file()
        raise NpqwenError(f"{path}: no adapter_model.safetensors" + (
            "; adapter_model.bin is a pickle, which npqwen does not read (loading one can run code): save it "
            "again with PEFT, save_pretrained(..., safe_serialization=True)" if bin_ else ""))
    try:
        infos = read_safetensors_header(file)
    except OSError as e:
        raise NpqwenError(f"{file}: cannot read it ({e})") from None
    # 1. every tensor is a lora_A or lora_B of a linear layer this model's layer has (layer_modules)
    cfg, found = model.config, {}
    for key in infos:
        m = WEIGHT.match(key)
        module = text_model(m.group(1)) if m else ""
        if module in model_modules(cfg):   # Qwen4-Exp's final mixing
            found.setdefault(module, {})[m.group(2)] = infos[key]
            continue
        layer = MODULE.match(module)
        if layer is None or module.rsplit(".", 1)[-1] not in LINEAR or ".experts." in module:
            raise NpqwenError(f"{file}: {key}: {refusal(key)}")
        i, where = int(layer.group(1)), layer.group(2)
        if i >= cfg.num_hidden_layers:
            raise NpqwenError(f"{file}: {key}: the base model has {cfg.num_hidden_layers} layers; this "
                              f"adapter was made for another base model")
        if where not in layer_modules(cfg, i):   # e.g. a q_proj on a linear-attention layer
            raise NpqwenError(f"{file}: {key}: layer {i} of this base model is {describe(cfg, i)}, which has no "
                              f"{where} (its linear layers: {', '.join(layer_modules(cfg, i))}); this adapter was "
                              f"made for another base model")
        found.setdefault(module, {})[m.group(2)] = infos[key]
    # 2. every module the config targets has its weights
    targets = config["target_modules"]
    for i in range(cfg.num_hidden_layers):
        for where in layer_modules(cfg, i):
            module = f"model.layers.{i}.{where}"
            if targeted(config, i, module) and module not in found:
                raise NpqwenError(f"{file}: the config targets {where.rsplit('.', 1)[-1]} (target_modules "
                                  f"{targets!r}) but the file has no weights for {module}; the file is incomplete "
                                  f"or belongs to another config")
    for module in model_modules(cfg):   # (PEFT adapts no module outside the layers when given layers_to_transform)
        if targeted(config, None, module) and module not in found:
            raise NpqwenError(f"{file}: the config targets {module.rsplit('.', 1)[-1]} (target_modules {targets!r}) "
                              f"but the file has no weights for {module}; the file is incomplete or belongs to "
                              f"another config")
    # 3. shapes: A (r, in), B (out, r) against the base weight (out, in) and the rank the config gives
    adapter = LoraAdapter(name, path, config["r"], key=f"{name}#{next(_loads)}")
    for module in sorted(found, key=lambda mod: order(cfg, mod)):
        parts = found[module]
        for part in ("lora_A", "lora_B"):
            if part not in parts:
                raise NpqwenError(f"{file}: {module} has no {part}.weight; the file is incomplete")
        layer = MODULE.match(module)
        i, where = layer.groups() if layer else (None, module)   # None: outside the layers (Qwen4-Exp's mixer)
        kind, t = where.rsplit(".", 1)                     # linear_attn, in_proj_qkv; mlp.shared_expert, up_proj
        out, in_ = model.weights[f"{module}.weight"].shape
        r = pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        A, B = parts["lora_A"], parts["lora_B"]
        if len(A.shape) != 2 or len(B.shape) != 2 or A.shape[1] != in_ or B.shape[0] != out:
            wrong = A if len(A.shape) != 2 or A.shape[1] != in_ else B
            want = ("r", in_) if wrong is A else (out, "r")
            raise NpqwenError(f"{file}: {wrong.name} has shape {tuple(wrong.shape)}, but this base model's {t} "
                              f"needs {want} (its weight is {(out, in_)}); this adapter was made for another "
                              f"base model")
        if A.shape[0] != r or B.shape[1] != r:
            raise NpqwenError(f"{file}: {module} has rank {A.shape[0]} in the weights (lora_A {tuple(A.shape)}, "
                              f"lora_B {tuple(B.shape)}), but the config says r={r} (r, rank_pattern); the config "
                              f"and the weights do not belong together")
        alpha = pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / r ** 0.5 if config.get("use_rslora") else alpha / r
        arrays = []
        for part in ("lora_A", "lora_B"):
            info = parts[part]
            if info.dtype not in ("F32", "F16", "BF16"):
                raise NpqwenError(f"{file}: {info.name} is {info.dtype}; npqwen reads F32, F16 and BF16 adapters")
            a = model.xp.empty(info.shape, dtype=model.dtype)
            read_tensor(info, a)
            adapter.weights[f"{module}.{part}.weight"] = a
            arrays.append(a)
        matrix, cols = fused_columns(model, None if i is None else int(i), kind, t)
        adapter.deltas.setdefault(matrix, []).append(Delta(module, cols, *arrays, float(scale)))
    if not adapter.deltas:
        raise NpqwenError(f"{file}: holds no LoRA weights")
    return adapter
