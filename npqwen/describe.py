"""`npqwen inspect`: a checkpoint's config and every weight, without loading the weights.

For a checkpoint directory only the safetensors headers are read (names, shapes, stored
dtypes), so it is instant even for large models; the built-in tiny models list their arrays.
A Qwen3-MoE layer's E experts are one line per projection (`experts.{0..E-1}.gate_proj.weight`,
x E), and the totals add the parameters a token actually uses.
"""
import dataclasses
import math
import re

import numpy as np

from . import quants
from .checkpoint import (MAX_NAMES_IN_WARNING, SCALE_SUFFIXES, canonical_names, check_config_matches, expected_shapes,
                         fused_expert_tensors, has_lm_head, index_checkpoint, matrix_shape, parameter_counts, size)
from .config import HYBRID_KEYS, MOE_DEFAULTS, QWEN4_KEYS, Qwen3Config
from .hub import resolve_model

EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(.+)$")   # prefix, expert, projection

GROUPS = ("embed", "layers", "norm", "lm_head")
SCALES = tuple(SCALE_SUFFIXES.values())   # FP8's weight_scale_inv, int8's weight_scale


def group_of(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embed"
    if name.startswith("model.layers."):
        return "layers"
    if name.startswith(("model.norm", "model.hyper_connection_mixer")):   # Qwen4-Exp's final mixing: the norm's place
        return "norm"
    return "lm_head"


def describe(model: str, device: str = "cpu", dtype: str = "float32") -> str:
    from .tiny import BUILTIN

    if str(model) in BUILTIN:
        from .tiny import tiny_model

        m = tiny_model(device, dtype, str(model))
        config, source = m.config, f"built-in {model} model (random weights, seed 0)"
        tensors = {n: (tuple(a.shape), str(a.dtype)) for n, a in m.weights.items()
                   if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    else:
        path = resolve_model(model)
        if path.is_file():   # a GGUF file: its metadata and tensors (their ggml types) under HF's names
            from .gguf_file import hf_tensors, indexer_parts, read_config

            config, tensors = read_config(path)
            tensors = {n: (t.shape, t.qtype) for n, t in hf_tensors(tensors).items()}
            for name, parts in indexer_parts(config, expected_shapes(config)).items():   # qwen4exp's q and k rows
                q, k = (tensors.pop(n, ((0, 0), "MISSING")) for n, _ in parts)
                tensors[name] = ((q[0][0] + k[0][0], *q[0][1:]), "+".join(dict.fromkeys((q[1], k[1]))))
            return render(config, tensors, f"{path} (GGUF)", lm_head=True, dtype=dtype)
        config, source = Qwen3Config.from_json(path / "config.json"), str(path)
        found = canonical_names(index_checkpoint(path))   # a Qwen3Model checkpoint's names get the model. prefix
        check_config_matches(config, found, path)   # before render sizes its table from the config
        tensors = {n: (matrix_shape(t), t.qtype or t.dtype) for n, t in found.items()   # ggml rows: Q4_K, ...
                   if not n.endswith(SCALES)}   # a compact matrix's scales are part of it
        if config.fused_experts:   # Qwen3-VL-MoE: each expert's projections are slices of its layer's two tensors
            shapes = expected_shapes(config)
            for layer in fused_expert_tensors(config, found, path, None).values():
                tensors.update({n: (shapes[n], layer["stored"][0].dtype) for n in layer["names"]})
        unread = [n for n in index_checkpoint(path) if n.startswith(("model.visual.", "mtp."))]
        return render(config, tensors, source, lm_head=has_lm_head(config, found), unread=unread, dtype=dtype)
    return render(config, tensors, source)


def qwen4_lines(config: Qwen3Config, tensors: dict, dtype) -> list[str]:
    """What a Qwen4-Exp request costs beyond Qwen3.5's: QSA's indexer keys in the KV cache, the PLE layers' states,
    and the PLE tables, which stay on disk (memory-mapped; a token reads Hn rows of each)."""
    from .checkpoint import STORED_DTYPES, ple_table_shapes
    from .kv_cache import KVCache, LinearStates, ple_conv_state_shape

    item = np.dtype(dtype).itemsize
    attention = [i for i in range(config.num_hidden_layers) if not config.is_linear_layer(i)]
    K, Dh, di = config.num_key_value_heads, config.head_dim, config.indexer_head_dim
    budget, r = config.indexer_budget, config.indexer_compress_ratio
    Hn = (config.ngram_size - 1) * config.heads_per_ngram
    lines = ["", "Qwen4-Exp (docs/qwen-families.md#3-qwen4-exp-qwen4_exp-qwen4_exp_text)",
             f"  hyper-connections          {config.hc_count} residual streams of {config.hidden_size} (a token's "
             f"residual is {config.hc_count * config.hidden_size} wide), mixed at rank {config.hc_lowrank}",
             f"  QSA layers                 {attention}: per token {2 * K * Dh * item:,} bytes of keys and values "
             f"+ {di * item:,} of the indexer's raw key per layer; a query reads at most {budget} + {r - 1} "
             f"tokens (its best {budget // r} blocks of {r} and its tail), the cache keeps every position (the "
             f"selection is recomputed from the indexer keys, so a prefix hit selects the same)",
             f"  KV cache per token         {KVCache.bytes_per_token(config, dtype):,} bytes in {dtype}"]
    if config.ple_layer_ids:
        layers = [n - 1 for n in config.ple_layer_ids]
        lines.append(f"  PLE layers                 {layers}: per request {len(layers)} x conv state "
                     f"{list(ple_conv_state_shape(config))} + the last {config.ngram_size - 1} token ids "
                     f"(state per request, all layers: {LinearStates.bytes_per_slot(config, dtype):,} bytes)")
        on_disk = params = 0
        for name, (rows, d) in ple_table_shapes(config).items():
            parts = [t for n, t in tensors.items() if n == name or n.startswith(name[:-len("weight")] + "shard_")]
            stored = parts[0][1] if parts else "MISSING"
            nbytes = (rows * d * STORED_DTYPES[stored][1] if stored in STORED_DTYPES else
                      rows * quants.row_bytes(stored, d) if stored in quants.BLOCKS else   # a GGUF's Q8_0 table
                      rows * d * np.dtype(stored).itemsize if stored != "MISSING" else 0)   # (built in: a dtype)
            on_disk, params = on_disk + nbytes, params + rows * d
            lines.append(f"    {name:<56} [{rows:,}, {d}] {stored} in {len(parts)} part(s), {size(nbytes)}")
        lines += [f"  PLE tables                 {params:,} parameters, {size(on_disk)}; a checkpoint's stay on disk, "
                  f"memory-mapped, not read into memory; a token reads {Hn} rows of {config.ple_embed_dim // Hn} per PLE layer (the hash "
                  f"constants: {'as the GGUF stores them' if config.ple_multipliers else 'computed from the config'})"]
    return lines


def hybrid_lines(config: Qwen3Config, unread, dtype) -> list[str]:
    """Which layers are linear attention, and what a token and a request cost in memory."""
    from .kv_cache import KVCache, LinearStates, conv_state_shape, recurrent_state_shape

    linear = [i for i in range(config.num_hidden_layers) if config.is_linear_layer(i)]
    full = [i for i in range(config.num_hidden_layers) if not config.is_linear_layer(i)]
    per_token, per_request = KVCache.bytes_per_token(config, dtype), LinearStates.bytes_per_slot(config, dtype)
    lines = ["", "hybrid layers (Gated DeltaNet linear attention; docs/linear-attention.md)",
             f"  linear attention           {len(linear)} layers: {linear}",
             f"  full attention             {len(full)} layers: {full}",
             f"  KV cache per token         {per_token:,} bytes in {dtype} (full-attention layers only)",
             f"  state per request          {per_request:,} bytes (conv {list(conv_state_shape(config))} and delta "
             f"rule {list(recurrent_state_shape(config))} per linear layer; the same at any context length)",
             f"  a 32k-token context        {(32768 * per_token + per_request) / 2**20:,.1f} MiB"]
    if unread:
        lines.append(f"  used for text: {len(unread)} tensors of the vision tower (model.visual.*) and the "
                     f"multi-token-prediction head (mtp.*) stay unread on disk (the head is read when a request "
                     f"speculates with it: docs/speculative.md)")
    return lines


def render(config: Qwen3Config, tensors: dict, source: str, lm_head: bool = True, unread=(), dtype="float32") -> str:
    """`tensors`: name -> (shape, dtype) as stored; the config says which are used and which are tied
    (lm_head False: a Qwen3Model checkpoint, which has none). `unread`: a Qwen3.5 hub checkpoint's vision
    tower and multi-token-prediction head, which npqwen leaves on disk."""
    lines = [f"{source}", "", "config"]
    hidden = () if config.hybrid else (*HYBRID_KEYS, "hybrid", "qwen3_next")   # Qwen3 has no hybrid fields
    hidden += ("attention_bias", "qk_norm") if config.qk_norm else ()          # shown for Qwen2, where they differ
    hidden += () if config.fused_experts else ("fused_experts",)                # shown for Qwen3-VL-MoE
    hidden += () if config.qwen4_exp else QWEN4_KEYS                            # shown for Qwen4-Exp
    for field in dataclasses.fields(config):
        if (config.num_experts or field.name not in MOE_DEFAULTS) and field.name not in hidden:
            lines.append(f"  {field.name:<26} {getattr(config, field.name)}")
    lines.append(f"  {'(derived) kv groups G':<26} {config.num_key_value_groups}")
    if config.hybrid:
        lines += hybrid_lines(config, unread, dtype)
    if config.qwen4_exp:
        lines += qwen4_lines(config, tensors, dtype)
        tensors = {n: t for n, t in tensors.items() if ".ple.ple_embedding." not in n}   # listed there
    expected = expected_shapes(config, lm_head)
    names = list(expected) + (["lm_head.weight"] if config.tie_word_embeddings else [])
    width = max(len(EXPERT.sub(rf"\1.{{0..{config.num_experts - 1}}}.\3", n)) for n in names) + 2
    total = unique = 0
    lines += ["", f"weights ({len(tensors)} tensors stored)"]
    for group in GROUPS:
        lines.append(f"  {group}")
        subtotal = 0
        for name in (n for n in names if group_of(n) == group):
            count = math.prod(expected.get(name, expected["model.embed_tokens.weight"]))
            if name == "lm_head.weight" and config.tie_word_embeddings:
                where = "stored, unused" if name in tensors else "not stored"
                lines.append(f"    {name:<{width}} tied to model.embed_tokens.weight ({where})")
                total += count
                continue
            expert = EXPERT.match(name)
            if expert and expert.group(2) != "0":
                continue   # counted on expert 0's line
            if expert:     # the E experts' copies of one projection, on one line
                prefix, _, part = expert.groups()
                missing = [e for e in range(config.num_experts) if f"{prefix}.{e}.{part}" not in tensors]
                if missing:
                    lines.append(f"    {f'{prefix}.{missing[0]}.{part}':<{width}} MISSING (expected "
                                 f"{list(expected[name])}; {len(missing)} of {config.num_experts} experts)")
                    continue
                name, count = f"{prefix}.{{0..{config.num_experts - 1}}}.{part}", count * config.num_experts
                shape, dtype = tensors[expert.group(0)]
                lines.append(f"    {name:<{width}} {str(list(shape)):<16} {dtype:<8} {count:>14,}  "
                             f"x{config.num_experts}")
                subtotal += count
                continue
            if name not in tensors:
                lines.append(f"    {name:<{width}} MISSING (expected {list(expected[name])})")
                continue
            shape, dtype = tensors[name]
            lines.append(f"    {name:<{width}} {str(list(shape)):<16} {dtype:<8} {count:>14,}")
            subtotal += count
        total += subtotal
        unique += subtotal
        if subtotal:
            lines.append(f"    {'subtotal':<{width}} {'':<16} {'':<8} {subtotal:>14,}")
    extra = sorted(set(tensors) - set(names))
    if extra:
        listed = ", ".join(extra[:MAX_NAMES_IN_WARNING])
        more = f" ... and {len(extra) - MAX_NAMES_IN_WARNING} more" if len(extra) > MAX_NAMES_IN_WARNING else ""
        lines.append(f"  not used by npqwen: {listed}{more}")
    lines += ["", f"total parameters:  {total:,}",
              f"unique parameters: {unique:,}" + ("  (tied lm_head counted once)" if config.tie_word_embeddings
                                                  else "")]
    if config.qwen4_exp and config.ple_layer_ids:
        from .checkpoint import ple_table_shapes
        lines.append(f"  (+ {sum(math.prod(s) for s in ple_table_shapes(config).values()):,} in the PLE tables, "
                     f"memory-mapped on disk)")
    if config.num_experts:
        k, E = config.num_experts_per_tok, config.num_experts
        lines.append(f"active per token:  {parameter_counts(config)[1]:,}  ({k} of {E} experts in each sparse layer)")
    lines += ["", "weights in memory by --weights format (the linear layers' matrices and the embedding in it; "
                  "norms and routers float32; docs/weights.md)"]
    if config.qwen4_exp:
        lines.append("  (Qwen4-Exp: the hyper-connections' projections in it too; the PLE tables stay on disk as stored)")
    lines += [f"  {fmt:<10} {size(nbytes):>10}" for fmt, nbytes in format_bytes(config, lm_head).items()]
    return "\n".join(lines)


def format_bytes(config: Qwen3Config, lm_head: bool = True) -> dict[str, int]:
    """The bytes the weights take in memory in each format (a tied lm_head counted once), scales included: what
    weights.total_bytes finds in them once loaded. A matrix whose rows are not whole blocks of a ggml format is kept
    in Q8_0 (or bfloat16), as npqwen.load does (weights.kept_format)."""
    from .checkpoint import is_matrix
    from .weights import FORMATS, matrix_bytes

    sizes = {}
    for fmt in ("float32", *FORMATS):
        total = 0
        for name, shape in expected_shapes(config, lm_head).items():
            if not is_matrix(name):
                total += math.prod(shape) * 4
                continue
            total += matrix_bytes(fmt, shape)
        sizes[fmt] = total
    return sizes
