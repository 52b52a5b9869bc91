"""Features inside the model: sparse autoencoders (SAEs) and transcoders, loaded without torch.

    sae = npqwen.load_sae("layer3.sae.pt", llm.config)                 # Qwen-Scope (a torch zip, read safely)
    sae = npqwen.load_sae("blocks.3.hook_resid_post/", llm.config)     # SAELens: cfg.json + sae_weights.safetensors
    tc = npqwen.load_sae("transcoders/layer_3.safetensors", llm.config)   # circuit-tracer per-layer transcoder
    run = llm.run_with_saes("The capital of France is", [sae, tc])
    run[0].indices, run[0].values            # (T, top) the strongest features per token and their activations
    llm.generate(prompt, feature_edits=[{"sae": sae, "feature": 123, "clamp": 8.0}])

An SAE reads an activation x (D,) at one step of the forward pass (its `reads`, an npqwen hook name,
npqwen/hooks.py) and writes it back as a sparse sum of F feature directions:

    pre  = (x - b_dec if subtract_b_dec else x) @ W_enc + b_enc     # (F,)
    acts = relu(pre)                  # standard SAE
         | pre * (pre > threshold)    # JumpReLU
         | top k of pre, relu'd       # TopK: the other F - k are 0
    x_hat = acts @ W_dec + b_dec      # (D,) the reconstruction; x - x_hat is its error

A transcoder reads the MLP's input and writes a guess of the MLP's output (`writes`, the down_proj step):
the same formulas, its error is the MLP output minus the guess. Arrays here use SAELens's orientation
(W_enc (D, F), W_dec (F, D)); Qwen-Scope and circuit-tracer store W_enc as (F, D) and are transposed on load.

A feature edit sets a feature's activation (clamp to a value, zero, scale by a factor) where the SAE reads
and adds the difference it makes to the reconstruction, (a' - a) * W_dec[f], to the activation: what the
SAE does not explain (its error) stays as it was, as SAELens and Neuronpedia steer.

Qwen4-Exp: a block's output (model.layers.L) is its C = hc_count residual streams of D side by side, so an
SAE there reads, and a feature edit there moves, all C*D values (W_enc (C*D, F), W_dec (F, C*D)); an SAE of
D reads the steps of D (a block's mixed input, model.layers.L.mlp_hyper_connection, or its output).
"""
import hashlib
import json
import math
import pickle
import re
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from .backend import to_numpy, xp_of
from .checkpoint import STORED_DTYPES, read_safetensors_header, read_tensor
from .errors import NpqwenError
from .hooks import check_names, residual_width

ARCHITECTURES = ("relu", "jumprelu", "topk")


@dataclass(frozen=True, eq=False)
class SAE:
    W_enc: np.ndarray           # (D, F) float32
    b_enc: np.ndarray           # (F,)
    W_dec: np.ndarray           # (F, D)
    b_dec: np.ndarray           # (D,)
    architecture: str           # "relu" (SAELens "standard"), "jumprelu" or "topk"
    reads: str                  # the npqwen hook name whose activation it encodes
    writes: str                 # where its reconstruction stands: `reads` for an SAE, the MLP output for a transcoder
    k: int | None = None        # TopK: features kept per token
    threshold: np.ndarray | None = None   # JumpReLU: (F,)
    subtract_b_dec: bool = False          # SAELens apply_b_dec_to_input: encode x - b_dec
    W_skip: np.ndarray | None = None      # circuit-tracer skip transcoder: (D, D), x @ W_skip.T added to the output
    source: str = ""                      # the file it came from, for messages
    model_name: str | None = None         # the model its file names, if any

    @property
    def kind(self) -> str:
        return "sae" if self.reads == self.writes else "transcoder"

    @property
    def width(self) -> int:
        return self.W_enc.shape[1]

    @cached_property
    def fingerprint(self) -> int:
        """A hash of its weights, computed once: an edited request's part of the prefix cache's key."""
        h = hashlib.blake2b(digest_size=8)
        for a in (self.W_enc, self.b_enc, self.W_dec, self.b_dec, self.threshold):
            if a is not None:
                h.update(np.ascontiguousarray(a).data)
        h.update(f"{self.architecture} {self.k} {self.subtract_b_dec} {self.reads}".encode())
        return int.from_bytes(h.digest(), "little")


# ---- the formulas ---------------------------------------------------------------------------------

def encode(sae: SAE, x: np.ndarray) -> np.ndarray:
    """Feature activations (T, F) of activations x (T, D)."""
    x = np.asarray(x, np.float32)
    pre = (x - sae.b_dec if sae.subtract_b_dec else x) @ sae.W_enc + sae.b_enc    # (T, D) @ (D, F) -> (T, F)
    if sae.architecture == "relu":
        return np.maximum(pre, 0)
    if sae.architecture == "jumprelu":
        return np.where(pre > sae.threshold, pre, 0).astype(np.float32)
    top = np.argpartition(-pre, sae.k - 1, axis=-1)[:, :sae.k]                   # (T, k) the k largest, any order
    acts = np.zeros_like(pre)
    np.put_along_axis(acts, top, np.maximum(np.take_along_axis(pre, top, -1), 0), -1)
    return acts


def decode(sae: SAE, acts: np.ndarray, x: np.ndarray | None = None) -> np.ndarray:
    """The reconstruction (T, D) of feature activations (T, F); x, the input, for a skip transcoder."""
    rows, feats = np.nonzero(acts)                                                   # the active (token, feature)s
    if len(feats) > acts.size // 16:   # dense enough (a ReLU SAE): one matrix product
        out = acts @ sae.W_dec + sae.b_dec                                           # (T, F) @ (F, D) -> (T, D)
    else:   # sparse (TopK: k of F per token): sum only the active features' decoder rows
        out = np.zeros((acts.shape[0], sae.W_dec.shape[1]), np.float32) + sae.b_dec   # (T, D)
        if len(feats):
            terms = acts[rows, feats, None] * sae.W_dec[feats]                      # (nnz, D), grouped by row
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])              # each row's first term
            out[rows[starts]] += np.add.reduceat(terms, starts, axis=0)
    if sae.W_skip is not None:
        out = out + np.asarray(x, np.float32) @ sae.W_skip.T
    return out


def top_features(acts: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """The `top` strongest features per token: indices (T, top) and their activations, strongest first."""
    top = min(top, acts.shape[1])
    idx = np.argsort(-acts, axis=-1, kind="stable")[:, :top]                          # (T, top)
    return idx, np.take_along_axis(acts, idx, -1)


@dataclass(frozen=True)
class FeatureRun:
    """One SAE's view of one prompt: the top features per token, the reconstruction and its error."""
    sae: SAE
    indices: np.ndarray          # (T, top) feature ids, strongest first
    values: np.ndarray           # (T, top) their activations
    acts: np.ndarray             # (T, F) every activation (mostly zero)
    reconstruction: np.ndarray   # (T, D) decode(encode(x)): for a transcoder, the replacement MLP's output
    error: np.ndarray            # (T, D) what it wrote minus the reconstruction (the activation / the MLP output)


def run_saes(cache: dict, saes, top: int) -> list[FeatureRun]:
    """Each SAE over the activations a run_with_cache kept (npqwen/llm.py run_with_saes)."""
    runs = []
    for sae in saes:
        x = cache[sae.reads]                                                          # (T, D)
        acts = encode(sae, x)
        recon = decode(sae, acts, x)
        idx, vals = top_features(acts, top)
        runs.append(FeatureRun(sae, idx, vals, acts, recon, cache[sae.writes] - recon))
    return runs


# ---- feature edits (per request, in the forward pass) ----------------------------------------------

@dataclass(frozen=True, eq=False)
class FeatureEdit:
    sae: SAE
    feature: int
    mode: str        # "clamp" (set to value), "zero", "scale" (multiply by value)
    value: float


def check_feature_edits(edits, config, field: str = "feature_edits") -> tuple[FeatureEdit, ...]:
    """A list of {"sae": SAE, "feature": f, and one of "clamp": v, "zero": True, "scale": s} checked against
    the model: the SAE must read a block's output (model.layers.L), where the edit is applied."""
    if edits is None:
        return ()
    if isinstance(edits, dict) or not isinstance(edits, (list, tuple)):
        raise NpqwenError(f"{field} must be a list of {{sae, feature, clamp|zero|scale}} items, got "
                          f"{type(edits).__name__}")
    out = []
    for j, item in enumerate(edits):
        at = f"{field}[{j}]"
        if isinstance(item, FeatureEdit):
            out.append(item)
            continue
        if not isinstance(item, dict):
            raise NpqwenError(f"{at} must be an object with sae, feature and one of clamp, zero, scale")
        unknown = set(item) - {"sae", "feature", "clamp", "zero", "scale"}
        if unknown:
            raise NpqwenError(f"{at} has unknown field {sorted(unknown)[0]!r}; it takes sae, feature and one of "
                              f"clamp, zero, scale")
        sae, feature = item.get("sae"), item.get("feature")
        if not isinstance(sae, SAE):
            raise NpqwenError(f"{at}.sae must be an SAE from npqwen.load_sae, got {type(sae).__name__}")
        check_against(sae, config)
        if not re.fullmatch(r"model\.layers\.\d+", sae.reads):
            raise NpqwenError(f"{at}: the SAE reads {sae.reads}; feature edits need an SAE on a block's output "
                              f"(model.layers.L, SAELens hook_resid_post)")
        if isinstance(feature, bool) or not isinstance(feature, (int, np.integer)) or not 0 <= feature < sae.width:
            raise NpqwenError(f"{at}.feature must be a feature from 0 to {sae.width - 1}, got {feature!r}")
        modes = [m for m in ("clamp", "zero", "scale") if m in item]
        if len(modes) != 1:
            raise NpqwenError(f"{at} must have exactly one of clamp (a value), zero (true) or scale (a factor)")
        mode = modes[0]
        if mode == "zero" and item["zero"] is not True:
            raise NpqwenError(f"{at}.zero must be true (leave it out to keep the feature)")
        value = 0.0 if mode == "zero" else item[mode]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
            raise NpqwenError(f"{at}.{mode} must be a finite number, got {value!r}")
        out.append(FeatureEdit(sae, int(feature), mode, float(value)))
    return tuple(out)


def edits_key(edits: tuple[FeatureEdit, ...]):
    """The prefix cache's part for an edited request (None: unedited): its keys and values are its own."""
    if not edits:
        return None
    return hash(tuple((e.sae.fingerprint, e.feature, e.mode, e.value) for e in edits))


def batch_feature_edits(rows) -> dict:
    """Layer -> [(edit, first row, n rows)] for one Batch; `rows` is (edits, first row, n rows) per sequence."""
    by_layer = {}
    for edits, first, n in rows:
        for e in edits:
            by_layer.setdefault(int(e.sae.reads.rsplit(".", 1)[1]), []).append((e, first, n))
    return by_layer


def apply_feature_edits(x, edits: list):
    """x (T, D) after a block, with each edit's rows moved by (a' - a) * W_dec[f] (its activation set)."""
    xp = xp_of(x)
    x = x.copy()
    for e, first, n in edits:
        rows = to_numpy(x[first:first + n]).astype(np.float32)                     # (n, D)
        a = encode(e.sae, rows)[:, e.feature]                                          # (n,)
        new = np.full_like(a, e.value) if e.mode == "clamp" else a * e.value          # zero: value 0, a * 0
        delta = (new - a)[:, None] * e.sae.W_dec[e.feature]                             # (n, D)
        x[first:first + n] += xp.asarray(delta, dtype=x.dtype)
    return x


# ---- labels -------------------------------------------------------------------------------------

def load_labels(path) -> dict[int, str]:
    """Feature descriptions from a Neuronpedia export: a JSON array of explanations, or JSON lines (its bulk
    export's batch files, gzipped or not), each {"modelId", "layer", "index": "123", "description": ...};
    feature -> the first description given for it."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise NpqwenError(f"{path}: cannot read the labels file ({e.strerror or e})") from None
    if raw[:2] == b"\x1f\x8b":   # a gzipped batch file
        import gzip
        raw = gzip.decompress(raw)
    try:
        text = raw.decode("utf-8").strip()
        items = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()
                                                                 if line.strip()]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NpqwenError(f"{path}: not a Neuronpedia export (a JSON array of explanations, or one explanation "
                          f"per line): {e}") from None
    labels = {}
    for j, item in enumerate(items):
        if not (isinstance(item, dict) and "index" in item and isinstance(item.get("description"), str)):
            raise NpqwenError(f"{path}: explanation {j} has no \"index\" and \"description\"; a Neuronpedia export's "
                              f"items look like {{\"index\": \"123\", \"description\": \"...\"}}")
        try:
            labels.setdefault(int(item["index"]), item["description"].strip())
        except (TypeError, ValueError):
            raise NpqwenError(f"{path}: explanation {j}'s index {item['index']!r} is not a feature number") from None
    return labels


# ---- loading ------------------------------------------------------------------------------------

def load_sae(path, config=None, hook: str | None = None) -> SAE:
    """An SAE or transcoder from a Qwen-Scope `layer{n}.sae.pt`, a SAELens folder (cfg.json + safetensors) or a
    circuit-tracer `layer_{n}.safetensors`; checked against `config` (the model's) when given. `hook`, an npqwen
    hook name, overrides where it reads (for a Qwen-Scope file: the block it was trained after)."""
    path = Path(path)
    if not path.exists():
        raise NpqwenError(f"{path}: no such file or folder; give a layer{{n}}.sae.pt file, a SAELens folder "
                          f"(cfg.json + sae_weights.safetensors) or a circuit-tracer layer_{{n}}.safetensors")
    if path.is_dir() and (path / "cfg.json").exists():
        sae = load_saelens(path)
    elif path.suffix == ".pt" or path.name.endswith(".pth"):
        sae = load_qwen_scope(path)
    elif path.suffix == ".safetensors":
        sae = load_circuit_tracer(path)
    else:
        raise NpqwenError(f"{path}: not an SAE this reads; give a layer{{n}}.sae.pt file (Qwen-Scope), a folder "
                          f"with cfg.json (SAELens) or a layer_{{n}}.safetensors file (circuit-tracer)")
    if hook is not None:
        sae = SAE(**{**sae.__dict__, "reads": hook, "writes": hook if sae.kind == "sae" else sae.writes})
    if config is not None:
        check_against(sae, config)
    return sae


def check_against(sae: SAE, config):
    """The SAE fits the model: the steps it reads and writes exist and its input width is the width of the step it
    reads: the hidden size D, or on Qwen4-Exp's residual (a block's output, its attn_residual, its ple) the C
    streams of D side by side, C*D, as hooks see them."""
    check_names([sae.reads, sae.writes], config, what="SAE hook")
    D, W = config.hidden_size, residual_width(config)
    on_streams = W != D and re.fullmatch(r"model\.layers\.\d+(\.attn_residual|\.ple)?", sae.reads)
    named = f" (its file names {sae.model_name})" if sae.model_name else ""
    if on_streams and sae.W_enc.shape[0] != W:
        raise NpqwenError(f"{sae.source}: the SAE reads vectors of {sae.W_enc.shape[0]} values but {sae.reads} of "
                          f"this Qwen4-Exp model is its {W // D} residual streams of {D}, {W} values{named}; an SAE "
                          f"of {D} reads a step of {D} (model.layers.L.mlp_hyper_connection, the MLP's input)")
    if not on_streams and sae.W_enc.shape[0] != D:
        raise NpqwenError(f"{sae.source}: the SAE reads vectors of {sae.W_enc.shape[0]} values but this model's "
                          f"hidden size is {D}{named}; load the SAE trained for this model")


def check_shapes(tensors: dict, architecture: str, source: str, k=None) -> tuple[int, int]:
    """(D, F) of W_enc (D, F), b_enc (F,), W_dec (F, D), b_dec (D,) [threshold (F,)], or a clear error."""
    for name in ("W_enc", "b_enc", "W_dec", "b_dec") + (("threshold",) if architecture == "jumprelu" else ()):
        if name not in tensors:
            raise NpqwenError(f"{source}: no tensor {name}; it has {', '.join(sorted(tensors))}")
    if tensors["W_enc"].ndim != 2:
        raise NpqwenError(f"{source}: W_enc must be a matrix, got shape {tensors['W_enc'].shape}")
    D, F = tensors["W_enc"].shape
    want = {"b_enc": (F,), "W_dec": (F, D), "b_dec": (D,), "threshold": (F,), "W_skip": (D, D)}
    for name, shape in want.items():
        if name in tensors and tensors[name].shape != shape:
            raise NpqwenError(f"{source}: {name} has shape {tensors[name].shape}, but W_enc {(D, F)} needs {shape}")
    if architecture not in ARCHITECTURES:
        raise NpqwenError(f"{source}: architecture {architecture!r} is not one this runs (standard, jumprelu, topk)")
    if architecture == "topk" and (not isinstance(k, int) or not 0 < k <= F):
        raise NpqwenError(f"{source}: a TopK SAE needs k from 1 to {F}, got {k!r}")
    for name, a in tensors.items():
        if not np.isfinite(a).all():
            raise NpqwenError(f"{source}: {name} holds NaN or infinite values; the file is corrupt")
    return D, F


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as a float32 (integer tensors as int64) NumPy array."""
    out = {}
    for name, info in read_safetensors_header(path).items():
        if info.dtype in STORED_DTYPES:
            a = np.empty(info.shape, np.float32)
            read_tensor(info, a)
        elif info.dtype in ("I64", "I32"):
            a = np.fromfile(path, dtype="<i8" if info.dtype == "I64" else "<i4", count=math.prod(info.shape),
                            offset=info.start).reshape(info.shape).astype(np.int64)
        else:
            raise NpqwenError(f"{path}: tensor {name} has dtype {info.dtype}, which an SAE does not hold")
        out[name] = a
    return out


# SAELens hook names (TransformerLens's) -> npqwen's. resid_pre of block L is block L-1's output.
SAELENS_HOOKS = {"hook_resid_post": "model.layers.{L}", "hook_resid_mid": "model.layers.{L}.attn_residual",
                 "hook_mlp_out": "model.layers.{L}.mlp.down_proj", "hook_attn_out": "model.layers.{L}.self_attn.o_proj",
                 "ln2.hook_normalized": "model.layers.{L}.post_attention_layernorm",
                 "mlp.hook_in": "model.layers.{L}.post_attention_layernorm",
                 "mlp.hook_out": "model.layers.{L}.mlp.down_proj"}


def npqwen_hook(name: str, source: str) -> str:
    """An npqwen hook name for a TransformerLens one (blocks.3.hook_resid_post), or the npqwen name itself."""
    if name.startswith("model."):
        return name
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m and m[2] == "hook_resid_pre":
        return "model.embed_tokens" if int(m[1]) == 0 else f"model.layers.{int(m[1]) - 1}"
    if m and m[2] in SAELENS_HOOKS:
        return SAELENS_HOOKS[m[2]].format(L=int(m[1]))
    raise NpqwenError(f"{source}: hook {name!r} is not one npqwen maps (blocks.L.{{{', '.join(SAELENS_HOOKS)}, "
                      f"hook_resid_pre}}); pass hook= with an npqwen hook name")


def load_saelens(folder: Path) -> SAE:
    """SAELens's layout: cfg.json (d_in, d_sae, hook_name, architecture, apply_b_dec_to_input, k) and
    sae_weights.safetensors (W_enc (d_in, d_sae), W_dec (d_sae, d_in), b_enc, b_dec, threshold for JumpReLU)."""
    try:
        cfg = json.loads((folder / "cfg.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise NpqwenError(f"{folder / 'cfg.json'}: not valid JSON ({e})") from None
    weights = next((folder / n for n in ("sae_weights.safetensors", "model.safetensors")
                    if (folder / n).exists()), None)
    if weights is None:
        raise NpqwenError(f"{folder}: cfg.json but no sae_weights.safetensors beside it")
    tensors = read_safetensors(weights)
    if "log_threshold" in tensors and "threshold" not in tensors:
        tensors["threshold"] = np.exp(tensors.pop("log_threshold"))
    architecture = {"standard": "relu"}.get(cfg.get("architecture", "standard"), cfg.get("architecture"))
    k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k"))
    D, F = check_shapes(tensors, architecture, str(weights), k)
    for key, want in (("d_in", D), ("d_sae", F)):
        if key in cfg and cfg[key] != want:
            raise NpqwenError(f"{folder}: cfg.json says {key} {cfg[key]}, but the weights have {want}")
    if "hook_name" not in cfg:
        raise NpqwenError(f"{folder / 'cfg.json'}: no hook_name; SAELens configs name where the SAE reads")
    reads = npqwen_hook(cfg["hook_name"], str(folder))
    return SAE(tensors["W_enc"], tensors["b_enc"], tensors["W_dec"], tensors["b_dec"], architecture, reads, reads,
               k=k, threshold=tensors.get("threshold"), subtract_b_dec=bool(cfg.get("apply_b_dec_to_input", False)),
               source=str(folder), model_name=cfg.get("model_name"))


def read_flat_yaml(path: Path) -> dict:
    """The top-level `key: value` lines of a config.yaml (circuit-tracer's), values as plain strings or numbers."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z_]\w*)\s*:\s*(.*?)\s*", line)
        if m and m[2] and not m[2].startswith("#"):
            value = m[2].strip("\"'")
            out[m[1]] = int(value) if value.isdigit() else value
    return out


def load_circuit_tracer(path: Path) -> SAE:
    """circuit-tracer's per-layer transcoder `layer_{n}.safetensors` (W_enc (F, D), W_dec (F, D), b_enc, b_dec,
    activation_function.threshold for JumpReLU, optional W_skip and k) with config.yaml beside it (model_name,
    feature_input_hook, feature_output_hook, activation, k); no config: the MLP's input and output."""
    m = re.search(r"(\d+)", path.stem)
    if m is None:
        raise NpqwenError(f"{path}: a circuit-tracer transcoder file is named layer_{{n}}.safetensors; this name "
                          f"has no layer number")
    layer = int(m[1])
    cfg = read_flat_yaml(path.parent / "config.yaml") if (path.parent / "config.yaml").exists() else {}
    t = read_safetensors(path)
    if "W_enc" in t:
        t["W_enc"] = np.ascontiguousarray(t["W_enc"].T)                                  # (F, D) -> (D, F)
    if "activation_function.threshold" in t:
        t["threshold"] = t.pop("activation_function.threshold")
    k = int(t.pop("k").reshape(-1)[0]) if "k" in t else cfg.get("k")
    architecture = cfg.get("activation") or ("jumprelu" if "threshold" in t else "topk" if k else "relu")
    check_shapes(t, architecture, str(path), k)
    reads = npqwen_hook(f"blocks.{layer}.{cfg.get('feature_input_hook', 'mlp.hook_in')}", str(path))
    writes = npqwen_hook(f"blocks.{layer}.{cfg.get('feature_output_hook', 'mlp.hook_out')}", str(path))
    return SAE(t["W_enc"], t["b_enc"], t["W_dec"], t["b_dec"], architecture, reads, writes, k=k,
               threshold=t.get("threshold"), W_skip=t.get("W_skip"), source=str(path),
               model_name=cfg.get("model_name"))


def load_qwen_scope(path: Path, k: int | None = None) -> SAE:
    """Qwen-Scope's `layer{n}.sae.pt`: a torch-saved dict W_enc (F, D), W_dec (D, F), b_enc (F,), b_dec (D,), a
    TopK SAE on the residual stream after block n. k is read from the folder name (...-L0_50 -> 50) or given."""
    m = re.fullmatch(r"layer(\d+)\.sae\.pt", path.name)
    if m is None:
        raise NpqwenError(f"{path}: a Qwen-Scope file is named layer{{n}}.sae.pt; rename it or give its layer")
    if k is None:
        found = re.search(r"L0_(\d+)", str(path.resolve().parent))
        k = int(found[1]) if found else None
    t = read_torch_file(path)
    if not isinstance(t, dict) or not all(isinstance(v, np.ndarray) for v in t.values()):
        raise NpqwenError(f"{path}: expected a dict of tensors (W_enc, W_dec, b_enc, b_dec)")
    t = {name: a.astype(np.float32) for name, a in t.items()}
    if "W_enc" in t and t["W_enc"].ndim == 2:
        t["W_enc"] = np.ascontiguousarray(t["W_enc"].T)                                   # (F, D) -> (D, F)
    if "W_dec" in t and t["W_dec"].ndim == 2:
        t["W_dec"] = np.ascontiguousarray(t["W_dec"].T)                                   # (D, F) -> (F, D)
    if k is None:   # the file itself does not say; Qwen-Scope's folders end in L0_50 or L0_100
        raise NpqwenError(f"{path}: the TopK k is not in the file; keep it in its Qwen-Scope folder (…-L0_50) "
                          f"or load it with npqwen.features.load_qwen_scope(path, k=50)")
    check_shapes(t, "topk", str(path), k)
    return SAE(t["W_enc"], t["b_enc"], t["W_dec"], t["b_dec"], "topk", f"model.layers.{int(m[1])}",
               f"model.layers.{int(m[1])}", k=k, source=str(path))


# ---- torch's zip files, without torch ------------------------------------------------------------

TORCH_STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
                  "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
                  "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


def rebuild_tensor(storage, offset, size, stride, *_):
    """torch._utils._rebuild_tensor_v2 with NumPy: a strided view of the storage, copied."""
    itemsize = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride)).copy()


def rebuild_parameter(data, *_):
    """torch._utils._rebuild_parameter: a Parameter is its tensor here."""
    return data


class StorageType:
    """What `torch.FloatStorage` & co. unpickle to: only their dtype is kept."""

    def __init__(self, name: str):
        self.name = name


class TensorUnpickler(pickle.Unpickler):
    """Unpickles torch.save's data.pkl allowing only what a dict of tensors needs; anything else (os.system,
    builtins.eval, ...) is refused before it can run."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor,
               ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
               ("collections", "OrderedDict"): OrderedDict}

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, source: str):
        super().__init__(file)
        self.archive, self.prefix, self.source = archive, prefix, source

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[(module, name)]
        if module == "torch" and name in TORCH_STORAGES:
            return StorageType(name)
        raise NpqwenError(f"{self.source}: refused to load: the file asks to run {module}.{name}, which a file of "
                          f"tensors never needs (it may be malicious); npqwen reads only tensors and dicts")

    def persistent_load(self, pid):
        # ('storage', storage type, key, location, numel): the bytes are in the zip at data/<key>
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageType)):
            raise NpqwenError(f"{self.source}: unknown persistent id in the pickle; not a torch.save file of tensors")
        kind, key = TORCH_STORAGES[pid[1].name], str(pid[2])
        try:
            raw = self.archive.read(f"{self.prefix}data/{key}")
        except KeyError:
            raise NpqwenError(f"{self.source}: storage {key} is missing from the zip; the file is truncated") from None
        if kind == "bfloat16":   # bf16 is a float32's top 16 bits
            return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        return np.frombuffer(raw, np.dtype(kind).newbyteorder("<"))


def read_torch_file(path: Path):
    """What torch.save wrote (its zip format: <name>/data.pkl + <name>/data/<key>), tensors as NumPy arrays."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise NpqwenError(f"{path}: not a torch zip file (torch.save's format since torch 1.6); legacy pickles "
                          f"are not read, since loading one can run code") from None
    with archive:
        pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pkl) != 1:
            raise NpqwenError(f"{path}: no single data.pkl inside; not a torch.save file")
        prefix = pkl[0][:-len("data.pkl")]
        byteorder = f"{prefix}byteorder"
        if byteorder in archive.namelist() and archive.read(byteorder).strip() != b"little":
            raise NpqwenError(f"{path}: saved big-endian; only little-endian torch files are read")
        with archive.open(pkl[0]) as f:
            try:
                return TensorUnpickler(f, archive, prefix, str(path)).load()
            except NpqwenError:
                raise
            except Exception as e:
                raise NpqwenError(f"{path}: could not read its pickle ({type(e).__name__}: {e})") from None
