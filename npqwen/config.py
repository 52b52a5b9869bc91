"""Qwen3 hyper-parameters, read from a checkpoint's config.json.

Field names are the keys of Hugging Face's config.json, so `config.hidden_size` here is
`"hidden_size"` there. Unknown keys are ignored; a missing required key or a value of the
wrong type is an NpqwenError that names the key.

Qwen2 / Qwen2.5 ("qwen2") is dense Qwen3 without QK-norm and with biases on q, k and v: two derived
fields, `qk_norm` and `attention_bias`, say so, and the attention step reads them (npqwen/model.py).
Qwen3-VL's language model ("qwen3_vl", "qwen3_vl_moe" and their "_text" model types) is read as the Qwen3 or
Qwen3-MoE it is for text (`qwen3_vl_text`).

Two model types: dense Qwen3 ("qwen3", e.g. Qwen3-0.6B) and the mixture of experts Qwen3-MoE
("qwen3_moe", e.g. Qwen3-30B-A3B), the same model except that most layers' MLP is a router
and E small expert MLPs of which each token uses k (npqwen/moe.py). A dense config has
num_experts 0.
"""
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import NpqwenError

ROPE_TYPES = ("default", "linear", "yarn")
LAYER_TYPES = ("full_attention", "linear_attention")
HYBRID_KEYS = ("layer_types", "partial_rotary_factor", "linear_conv_kernel_dim", "linear_key_head_dim",
               "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
               "shared_expert_intermediate_size")
QWEN4_KEYS = ("qwen4_exp", "hc_count", "hc_lowrank", "ple_layer_ids", "ple_embed_dim", "ple_conv_kernel_size",
              "ngram_size", "heads_per_ngram", "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by", "seed",
              "ple_multipliers", "output_gate_type",
              "split_ngram_parts", "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
              "indexer_compress_ratio")
QWEN3_NEXT_DEFAULTS = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, norm_topk_prob=True,
                          shared_expert_intermediate_size=512, decoder_sparse_step=1, mlp_only_layers=[],
                          intermediate_size=5632)
MAX_LAYERS_LISTED = 10_000   # a default layer_types is only built for a plausible num_hidden_layers
MAX_SIZE = 2**31 - 1   # any size above this is a typo; the tensors in the file bound the real ones

# Qwen/Qwen3-0.6B's config.json, the reference shape: 28 layers, D=1024, 16/8 heads of 128, F=3072.
QWEN3_0_6B_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
    eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=1024, initializer_range=0.02,
    intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28, model_type="qwen3",
    num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-06,
    rope_scaling=None, rope_theta=1000000, sliding_window=None, tie_word_embeddings=True,
    torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936,
)
# Qwen/Qwen3-30B-A3B's config.json: 48 layers, D=2048, 32/4 heads of 128, 128 experts of width 768, 8 per token.
QWEN3_30B_A3B_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
    decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_act="silu", hidden_size=2048,
    initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48,
    mlp_only_layers=[], model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True,
    num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4,
    output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000,
    router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
    use_cache=True, use_sliding_window=False, vocab_size=151936,
)
# Qwen/Qwen3.5-0.8B's text model (its config.json's text_config): 24 layers, 18 linear; D=1024, 8/2 heads of 256
QWEN3_5_0_8B_TEXT_CONFIG = dict(
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024,
    intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
    hidden_act="silu", attention_bias=False, eos_token_id=248044,
    layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(24)],
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
# transformers' Qwen3MoeConfig defaults, for the keys a "qwen3_moe" config.json leaves out
MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                    decoder_sparse_step=1, mlp_only_layers=None)
# Qwen/Qwen3-0.6B's generation_config.json
QWEN3_0_6B_GENERATION_CONFIG = dict(bos_token_id=151643, do_sample=True, eos_token_id=[151645, 151643],
                                    pad_token_id=151643, temperature=0.6, top_k=20, top_p=0.95)


@dataclass(frozen=True)
class Qwen3Config:
    hidden_size: int                # D: width of the residual stream (1024 in Qwen3-0.6B)
    intermediate_size: int          # F: width of the SwiGLU MLP (3072)
    num_hidden_layers: int          # number of decoder layers (28)
    num_attention_heads: int        # H: query heads (16)
    vocab_size: int                 # V: rows of the embedding and of lm_head (151936)
    num_key_value_heads: int | None = None   # K: key/value heads, shared by H/K query heads (8); default H
    head_dim: int | None = None     # Dh: width of one head (128); default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6      # epsilon inside every RMSNorm
    rope_theta: float = 10000.0     # RoPE base; Qwen3 uses 1e6
    rope_scaling: dict | None = None  # None, or {"rope_type": "linear" | "yarn", "factor": ..., ...}
    max_position_embeddings: int = 32768  # context length: positions 0 .. this - 1 (40960)
    tie_word_embeddings: bool = False     # lm_head.weight is model.embed_tokens.weight (True in 0.6B)
    # Qwen2 / Qwen2.5 ("qwen2"): q, k and v have biases and there is no QK-norm; set from model_type (HF's
    # Qwen2Attention always has the three biases and no o_proj bias, whatever config.json says)
    attention_bias: bool = False    # q_proj, k_proj, v_proj add a bias (Qwen2); Qwen3's have none
    qk_norm: bool = True            # RMSNorm over each head's q and k before RoPE (Qwen3); Qwen2 has none
    # Qwen3-VL-MoE's hub layout ("qwen3_vl_moe"): each layer's experts stored as two tensors, x @ W oriented,
    # mlp.experts.gate_up_proj (E, D, 2I) and mlp.experts.down_proj (E, I, D); set from model_type
    fused_experts: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # 151645 (<|im_end|>) in Qwen3-0.6B
    # Mixture of experts ("qwen3_moe"; Qwen3-30B-A3B's values). router_aux_loss_coef and
    # output_router_logits only matter for training and are ignored.
    num_experts: int = 0            # E: experts in each sparse layer (128); 0 = dense. Also read as num_local_experts
    num_experts_per_tok: int = 0    # k: experts each token is routed to (8)
    moe_intermediate_size: int = 0  # I: width of one expert's SwiGLU (768)
    norm_topk_prob: bool = False    # rescale each token's k router probabilities to sum 1 (true)
    decoder_sparse_step: int = 1    # layer i is sparse when (i + 1) % decoder_sparse_step == 0 (1: every layer)
    mlp_only_layers: list[int] | None = None  # layers that keep the dense MLP of intermediate_size; kept as a tuple
    # Hybrid models ("qwen3_5_text", "qwen3_5"; Qwen3.5-0.8B's values): layer_types picks full attention or
    # Gated DeltaNet linear attention per layer (npqwen/linear_attention.py); their norms scale by 1 + weight,
    # and full attention has an output gate (q_proj yields query and gate) and rotates only part of each head.
    hybrid: bool = False            # set from model_type (not a config.json key)
    qwen3_next: bool = False        # set from model_type: Qwen3-Next's linear projections come interleaved by key
                                    # head (in_proj_qkvz, in_proj_ba) where Qwen3.5 has four
    layer_types: list[str] | None = None  # "linear_attention" or "full_attention" per layer; kept as a tuple
    partial_rotary_factor: float = 1.0    # RoPE turns the first Dh * this of each head (0.25)
    linear_conv_kernel_dim: int = 4       # W: the causal convolution's kernel (4)
    linear_key_head_dim: int = 128        # dk (128)
    linear_value_head_dim: int = 128      # dv (128)
    linear_num_key_heads: int = 16        # Hk (16)
    linear_num_value_heads: int = 32      # Hv (16), a multiple of Hk
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: every token also runs a shared expert this wide (512)
    # Qwen4-Exp ("qwen4_exp", "qwen4_exp_text"; transformers' defaults): a Qwen3.5-MoE with hyper-connections (C
    # residual streams, npqwen/hyper_connections.py), QSA on its full-attention layers (npqwen/qsa.py) and
    # Per-Layer Embeddings on some linear ones (npqwen/ple.py); no input/post-attention/final RMSNorm
    qwen4_exp: bool = False         # set from model_type
    hc_count: int = 4               # C: residual streams (4)
    hc_lowrank: int = 320           # R: rank of the learned mixing of the streams (320)
    ple_layer_ids: list[int] | None = None   # one-indexed layers with PLE; kept as a tuple
    ple_embed_dim: int | None = None         # E_ple: the n-gram embeddings of a token side by side; default D
    ple_conv_kernel_size: int = 4            # the PLE convolution's kernel, dilated by ngram_size
    ngram_size: int = 3                      # n: the longest n-gram hashed (2- and 3-grams)
    heads_per_ngram: int = 8                 # hash heads (one table each) per n-gram order
    ngram_vocab_size_base: int = 20_000_000  # a head's table has the next prime above this many rows
    make_ngram_vocab_size_divisible_by: int = 128   # the joined tables are padded to a multiple of this
    seed: int = 1234                         # seeds the hash multipliers
    output_gate_type: str = "silu"           # the Gated DeltaNet output gate: SiLU (hidden_act) or sigmoid
    ple_multipliers: list[int] | None = None   # a GGUF's: its PLE layer's hash multipliers as stored (else from seed)
    split_ngram_parts: int = 512             # the table's shards on disk (ngram_embedding.shard_N.weight)
    indexer_n_heads: int | None = None       # Hi: QSA indexer query heads
    indexer_kv_heads: int | None = None      # its key heads: 1
    indexer_head_dim: int | None = None      # di
    indexer_budget: int | None = None        # tokens of whole blocks a query may read, besides its tail
    indexer_compress_ratio: int | None = None   # r: tokens per block

    def __post_init__(self):
        # Derived values, computed in this one place.
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            if not 0 < getattr(self, name) <= MAX_SIZE:
                raise NpqwenError(f"config: {name} must be between 1 and {MAX_SIZE}, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise NpqwenError(f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                              f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise NpqwenError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise NpqwenError("config: rms_norm_eps and rope_theta must be positive")
        object.__setattr__(self, "rope_scaling",
                           _check_rope_scaling(self.rope_scaling, self.max_position_embeddings))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if self.num_experts:
            _check_experts(self)
        object.__setattr__(self, "layer_types", tuple(self.layer_types or ()))   # () in Qwen3: every layer full
        object.__setattr__(self, "ple_layer_ids", tuple(self.ple_layer_ids or ()))
        if self.ple_multipliers is not None:
            object.__setattr__(self, "ple_multipliers", tuple(int(m) for m in self.ple_multipliers))
        if self.ple_embed_dim is None:
            object.__setattr__(self, "ple_embed_dim", self.hidden_size)
        if self.hybrid:
            _check_hybrid(self)

    def is_ple_layer(self, i: int) -> bool:
        """Whether layer i (0-indexed) adds Qwen4-Exp's Per-Layer Embeddings to its streams first."""
        return i + 1 in self.ple_layer_ids

    def ple_index(self, i: int) -> int:
        """Layer i's place among the PLE layers (its hash seeds and its row of the PLE states)."""
        return self.ple_layer_ids.index(i + 1)

    def is_linear_layer(self, i: int) -> bool:
        """Whether layer i is Gated DeltaNet linear attention (else full attention)."""
        return self.hybrid and self.layer_types[i] == "linear_attention"

    def cache_index(self, i: int) -> int:
        """Layer i's place among the layers of its kind: its KV cache row, or its linear-attention state row."""
        if not self.hybrid:
            return i
        return sum(self.is_linear_layer(j) == self.is_linear_layer(i) for j in range(i))

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache (all of them in Qwen3)."""
        return self.layer_types.count("full_attention") if self.hybrid else self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        """How many of each head's Dh values RoPE turns (all in Qwen3; a quarter in Qwen3.5)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def norm_offset(self) -> float:
        """Qwen3.5's RMSNorms scale by 1 + weight (their weights are stored centred on 0); Qwen3's by weight."""
        return 1.0 if self.hybrid else 0.0

    @property
    def model_type(self) -> str:
        if self.qwen4_exp:
            return "qwen4_exp_text"
        if self.hybrid:
            return "qwen3_next" if self.qwen3_next else "qwen3_5_moe_text" if self.num_experts else "qwen3_5_text"
        if not self.qk_norm:
            return "qwen2"
        return "qwen3_moe" if self.num_experts else "qwen3"

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the sparse mixture of experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def num_key_value_groups(self) -> int:
        """G = H / K: how many query heads read the same key/value head (2 in Qwen3-0.6B)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    def to_dict(self) -> dict:
        """This config as a config.json: HF's keys, architectures and model_type; a dense one without expert keys."""
        raw = {**dataclasses.asdict(self), "mlp_only_layers": list(self.mlp_only_layers),
               "layer_types": list(self.layer_types)}
        if not self.num_experts:
            for key in MOE_DEFAULTS:
                raw.pop(key)
        if not self.hybrid:
            for key in HYBRID_KEYS:
                raw.pop(key)
        raw["ple_layer_ids"] = list(self.ple_layer_ids)
        if not self.qwen4_exp:
            for key in QWEN4_KEYS:
                raw.pop(key)
        if raw.get("ple_multipliers", 0) is None:   # (only a GGUF's config has its own)
            raw.pop("ple_multipliers")
        raw.pop("hybrid")
        raw.pop("qwen4_exp", None)
        raw.pop("qk_norm")
        raw.pop("fused_experts")
        if self.qk_norm:   # (a Qwen3's attention_bias is false; Qwen2's biases are implied by its model_type)
            raw.pop("attention_bias")
        architecture = "Qwen2ForCausalLM" if not self.qk_norm else \
            "Qwen3MoeForCausalLM" if self.num_experts else "Qwen3ForCausalLM"
        architecture = ("Qwen3_5MoeForCausalLM" if self.num_experts else "Qwen3_5ForCausalLM") if self.hybrid \
            else architecture
        architecture = "Qwen3NextForCausalLM" if self.qwen3_next else architecture
        architecture = "Qwen4ExpForCausalLM" if self.qwen4_exp else architecture
        raw.pop("qwen3_next")
        return {"architectures": [architecture], "model_type": self.model_type, **raw}

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "Qwen3Config":
        """Build from a parsed config.json; `source` names the file in error messages."""
        if not isinstance(raw, dict):
            raise NpqwenError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type in ("qwen4_exp", "qwen4_exp_text"):
            raw, model_type = qwen4_exp_text(raw, model_type, source)   # Qwen4-Exp's text model (its own checks)
        if model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_vl_text", "qwen3_vl_moe_text"):
            raw, model_type = qwen3_vl_text(raw, model_type, source)   # Qwen3-VL's text model: a Qwen3 (-MoE)
        if model_type in ("qwen3_5", "qwen3_5_moe") and isinstance(raw.get("text_config"), dict):
            # the hub's Qwen3_5(Moe)ForConditionalGeneration: npqwen reads its text model (model.language_model.*).
            # Its lm_head is the outer model's, tied as the top-level config says (transformers reads the model's
            # own config, Qwen3_5Config's default False), whatever text_config says.
            model_type += "_text"
            raw = {**raw["text_config"], "tie_word_embeddings": raw.get("tie_word_embeddings", False),
                   "model_type": model_type}
        if model_type not in ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen2",
                              "qwen4_exp_text"):
            raise NpqwenError(f"{source}: model_type is {model_type!r}, but npqwen runs Qwen3 checkpoints: "
                              f"model_type 'qwen3' (dense, e.g. Qwen/Qwen3-0.6B), 'qwen3_moe' (mixture of "
                              f"experts, e.g. Qwen/Qwen3-30B-A3B), or Qwen3.5's 'qwen3_5' / 'qwen3_5_text' "
                              f"(e.g. Qwen/Qwen3.5-0.8B), 'qwen3_5_moe' and 'qwen3_next', Qwen2.5's 'qwen2' "
                              f"(e.g. Qwen/Qwen2.5-0.5B) and Qwen4-Exp's 'qwen4_exp' / 'qwen4_exp_text'")
        raw = dict(raw)
        raw["qk_norm"] = model_type != "qwen2"   # Qwen2: no QK-norm, and q, k, v with biases (below)
        raw["hybrid"] = model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text")
        raw["qwen4_exp"] = model_type == "qwen4_exp_text"
        raw["qwen3_next"] = model_type == "qwen3_next"
        if model_type == "qwen3_next":   # transformers' Qwen3NextConfig defaults (Qwen3-Next-80B-A3B)
            for key, value in QWEN3_NEXT_DEFAULTS.items():
                raw[key] = value if raw.get(key) is None else raw[key]
        if model_type in ("qwen3_5_moe_text", "qwen4_exp_text"):   # every layer sparse, k weights renormalised, no dense MLP
            E, k = (512, 10) if model_type == "qwen4_exp_text" else (256, 8)   # transformers' defaults
            raw.update(num_experts=raw.get("num_experts", E), num_experts_per_tok=raw.get("num_experts_per_tok", k),
                       moe_intermediate_size=raw.get("moe_intermediate_size", 512), norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[],
                       shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 512))
            raw.setdefault("intermediate_size", raw["shared_expert_intermediate_size"])   # (no dense layer uses it)
        if raw["hybrid"]:   # transformers' Qwen3_5TextConfig defaults: every fourth layer full attention
            rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
            raw.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0 if raw["qwen4_exp"] else 0.25))
            raw.setdefault("head_dim", 256)
            if raw.get("layer_types") is None and isinstance(raw.get("num_hidden_layers"), int):
                every = raw.get("full_attention_interval", 4)
                raw["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention"
                                      for i in range(min(raw["num_hidden_layers"], MAX_LAYERS_LISTED))]
        if model_type in ("qwen3_moe", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text"):   # transformers saves num_experts as num_local_experts
            raw.setdefault("num_experts", raw.get("num_local_experts"))
            raw.update({k: v for k, v in MOE_DEFAULTS.items() if raw.get(k) is None})
        else:                           # a dense Qwen3 has no experts, whatever else its config.json says
            for key in MOE_DEFAULTS:
                raw.pop(key, None)
        _check_unsupported(raw, source)
        raw["attention_bias"] = model_type == "qwen2"
        if not raw["hybrid"]:   # checked above; a Qwen3 has full attention over whole heads
            for key in HYBRID_KEYS:
                raw.pop(key, None)
        # Newer transformers (>= 5) store rope_theta and the scaling inside "rope_parameters".
        rope_parameters = raw.get("rope_parameters")
        if isinstance(rope_parameters, dict):
            rope_parameters = dict(rope_parameters)
            if "rope_theta" in rope_parameters and "rope_theta" not in raw:
                raw["rope_theta"] = rope_parameters.pop("rope_theta")
            rope_parameters.pop("rope_theta", None)
            rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
            if rope_type != "default" and raw.get("rope_scaling") is None:
                raw["rope_scaling"] = rope_parameters
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in raw or (raw[field.name] is None and field.default is dataclasses.MISSING):
                if field.default is dataclasses.MISSING:
                    raise NpqwenError(f"{source}: required field {field.name!r} is missing")
                continue
            values[field.name] = _check_type(field.name, raw[field.name], field.type, source)
        return cls(**values)

    @classmethod
    def from_json(cls, path) -> "Qwen3Config":
        path = Path(path)
        if not path.is_file():
            raise NpqwenError(f"{path} not found: a Qwen3 checkpoint directory holds config.json, "
                              f"model.safetensors (or shards) and tokenizer.json")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:   # ValueError: also a 5000-digit number
            raise NpqwenError(f"{path}: not valid JSON ({str(e)[:200]})") from None
        return cls.from_dict(raw, source=str(path))


QWEN4_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def qwen4_exp_text(raw: dict, model_type: str, source: str) -> tuple[dict, str]:
    """Qwen4-Exp's language model: the hub's Qwen4ExpForConditionalGeneration config is read for its text_config
    (model.language_model.* in the weights; model.visual.* and mtp.* stay on disk), with its own checks: what
    transformers' Qwen4ExpTextConfig.validate_architecture refuses, and what npqwen does not implement, by name."""
    if model_type == "qwen4_exp":
        if not isinstance(raw.get("text_config"), dict):
            raise NpqwenError(f"{source}: model_type 'qwen4_exp' needs a text_config (the language model's config); "
                              f"npqwen reads the text model of Qwen4-Exp")
        raw = {**raw["text_config"], "tie_word_embeddings": raw.get("tie_word_embeddings", False)}
    raw = dict(raw)
    gate = raw.get("output_gate_type") or raw.get("hidden_act", "silu")
    if gate not in ("silu", "sigmoid"):
        raise NpqwenError(f"{source}: output_gate_type {gate!r}: npqwen's Gated DeltaNet gates its output with SiLU "
                          f"(Qwen4-Exp's default) or a sigmoid (as transformers); a {gate} output gate is not "
                          f"implemented")
    raw["output_gate_type"] = gate
    streams = raw.get("hc_count", 4)
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 2:
        raise NpqwenError(f"{source}: hc_count must be an integer above 1 (Qwen4-Exp's residual streams), "
                          f"got {streams!r}")
    unknown = sorted(k for k in raw if (k.startswith(("indexer_", "qsa", "index_")) and k not in QWEN4_QSA))
    if unknown:
        raise NpqwenError(f"{source}: {unknown[0]!r} describes a QSA variant npqwen does not implement; it runs "
                          f"Qwen4-Exp's QSA as transformers does, set by {', '.join(QWEN4_QSA)} only")
    qsa = {k: raw.get(k) for k in QWEN4_QSA}
    types = raw.get("layer_types")
    if isinstance(types, list):   # the hub's config says "full_attention" for its QSA layers, as transformers reads it
        raw["layer_types"] = ["full_attention" if t in ("full_attention", "indexed_attention") else t for t in types]
    if any(v is None for v in qsa.values()):
        raise NpqwenError(f"{source}: Qwen4-Exp's attention layers are QSA, which needs all of {', '.join(QWEN4_QSA)}; "
                          f"missing: {', '.join(k for k, v in qsa.items() if v is None)}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in qsa.values()):
        raise NpqwenError(f"{source}: the QSA sizes must be positive integers, got {qsa}")
    if qsa["indexer_kv_heads"] != 1:
        raise NpqwenError(f"{source}: indexer_kv_heads {qsa['indexer_kv_heads']}: a QSA variant with several indexer "
                          f"key heads; Qwen4-Exp's QSA (and transformers') has one key head, as npqwen implements")
    if qsa["indexer_budget"] % qsa["indexer_compress_ratio"]:
        raise NpqwenError(f"{source}: indexer_budget {qsa['indexer_budget']} is not a multiple of "
                          f"indexer_compress_ratio {qsa['indexer_compress_ratio']}: QSA keeps whole blocks")
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    section = rope.get("mrope_section")
    if section is not None and not (isinstance(section, list) and len(section) == 3
                                    and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                            for n in section)):
        raise NpqwenError(f"{source}: rope_parameters.mrope_section {section!r} is not a multimodal RoPE layout "
                          f"npqwen knows (three counts of frequencies, for time, height and width); npqwen reads "
                          f"text only, where the three positions are equal and any such layout is plain RoPE")
    head_dim, rotary = raw.get("head_dim", 256), None
    if isinstance(head_dim, int):
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        if rotary > qsa["indexer_head_dim"]:
            raise NpqwenError(f"{source}: RoPE turns {rotary} values of each head but the QSA indexer's heads have "
                              f"indexer_head_dim {qsa['indexer_head_dim']}; they must fit (transformers refuses it)")
    ple_ids = raw.get("ple_layer_ids") or []
    if ple_ids:
        if not (isinstance(ple_ids, list) and all(isinstance(n, int) for n in ple_ids)):
            raise NpqwenError(f"{source}: ple_layer_ids should be a list of layer numbers, got {ple_ids!r}")
        raw["ple_layer_ids"] = sorted(set(ple_ids))
        n, heads = raw.get("ngram_size", 3), raw.get("heads_per_ngram", 8)
        dim = raw.get("ple_embed_dim") or raw.get("hidden_size")
        if not (isinstance(n, int) and isinstance(heads, int) and n > 1 and heads > 0 and isinstance(dim, int)
                and dim % ((n - 1) * heads) == 0):
            raise NpqwenError(f"{source}: ple_embed_dim {dim} must be a multiple of the (ngram_size - 1) * "
                              f"heads_per_ngram = {(n - 1) * heads if isinstance(n, int) and isinstance(heads, int) else '?'} "
                              f"hash heads (ngram_size {n!r} > 1)")
        layers = raw.get("num_hidden_layers")
        bad = [i for i in raw["ple_layer_ids"] if not isinstance(layers, int) or not 1 <= i <= layers]
        if bad:
            raise NpqwenError(f"{source}: ple_layer_ids {bad} name no layer: they count layers from 1 to "
                              f"num_hidden_layers ({layers})")
        if raw.get("eos_token_id") in (None, []):
            raise NpqwenError(f"{source}: PLE needs eos_token_id (an n-gram never reaches past an end of text)")
    return raw, "qwen4_exp_text"


def qwen3_vl_text(raw: dict, model_type: str, source: str) -> tuple[dict, str]:
    """Qwen3-VL's language model as the Qwen3 (or Qwen3-MoE) it is for text: the hub's
    Qwen3VL(Moe)ForConditionalGeneration config is read for its text_config (model.language_model.* in the
    weights; model.visual.* stays on disk). Its multimodal RoPE (mrope_section) gives each frequency the
    position of one of three streams (time, height, width); text alone has all three equal to the token's
    position, so it is plain RoPE over the whole head. Qwen3-VL-MoE's router always renormalises its k
    weights, and its hub files store each layer's experts as two tensors (fused_experts)."""
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        if not isinstance(raw.get("text_config"), dict):
            raise NpqwenError(f"{source}: model_type {model_type!r} needs a text_config (the language model's "
                              f"config); npqwen reads the text model of Qwen3-VL")
        # transformers ties lm_head by the outer config's tie_word_embeddings (default false), not text_config's
        raw = {**raw["text_config"], "tie_word_embeddings": raw.get("tie_word_embeddings", False)}
    raw = dict(raw)
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else raw.get("rope_scaling")
    section = (rope or {}).get("mrope_section")
    head_dim = raw.get("head_dim") or (raw.get("hidden_size", 0) // max(1, raw.get("num_attention_heads", 1)))
    if section is not None and not (isinstance(section, list) and len(section) == 3
                                    and all(isinstance(n, int) and n >= 0 for n in section)
                                    and sum(section) == head_dim // 2):
        raise NpqwenError(f"{source}: rope_parameters.mrope_section {section!r} is not Qwen3-VL's multimodal RoPE "
                          f"(three counts of frequencies, for time, height and width, that add up to head_dim / 2 "
                          f"= {head_dim // 2}); npqwen reads text only, where the three positions are equal, and "
                          f"cannot say what this layout means")
    if model_type.startswith("qwen3_vl_moe"):
        raw.update(norm_topk_prob=True, fused_experts=True)
        return raw, "qwen3_moe"
    return raw, "qwen3"


def _check_experts(config: Qwen3Config):
    """The mixture-of-experts sizes, checked against each other (the tensors check the rest)."""
    E, k = config.num_experts, config.num_experts_per_tok
    for name in ("num_experts", "moe_intermediate_size", "decoder_sparse_step"):
        if not 0 < getattr(config, name) <= MAX_SIZE:
            raise NpqwenError(f"config: {name} must be between 1 and {MAX_SIZE}, got {getattr(config, name)}")
    if not 1 <= k <= E:
        raise NpqwenError(f"config: num_experts_per_tok must be between 1 and num_experts ({E}), got {k}")
    bad = [i for i in config.mlp_only_layers if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise NpqwenError(f"config: mlp_only_layers {list(config.mlp_only_layers)} names layer {bad[0]}, but the "
                          f"model has layers 0 .. {config.num_hidden_layers - 1}")


def _check_hybrid(config: Qwen3Config):
    """A Qwen3.5 config's layer types and linear-attention sizes, checked against each other."""
    types = config.layer_types
    if len(types) != config.num_hidden_layers:
        raise NpqwenError(f"config: layer_types lists {len(types)} layers but num_hidden_layers is "
                          f"{config.num_hidden_layers}; give one type per layer")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise NpqwenError(f"config: layer_types holds {unknown[0]!r}, which npqwen does not know; each layer is "
                          f"one of {', '.join(LAYER_TYPES)}")
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads"):
        if not 0 < getattr(config, name) <= MAX_SIZE:
            raise NpqwenError(f"config: {name} must be between 1 and {MAX_SIZE}, got {getattr(config, name)}")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise NpqwenError(f"config: linear_num_value_heads ({config.linear_num_value_heads}) must be a multiple of "
                          f"linear_num_key_heads ({config.linear_num_key_heads})")
    not_linear = [n for n in config.ple_layer_ids if types[n - 1] != "linear_attention"]
    if not_linear:
        raise NpqwenError(f"config: ple_layer_ids {not_linear} are attention layers; Qwen4-Exp's Per-Layer Embeddings "
                          f"are on linear_attention layers only (transformers refuses the rest too)")
    if not 0 < config.partial_rotary_factor <= 1 or config.rotary_dim % 2:
        raise NpqwenError(f"config: partial_rotary_factor {config.partial_rotary_factor} must be in (0, 1] and turn "
                          f"an even number of each head's {config.head_dim} values")


def _check_type(name, value, annotation, source):
    """Return `value` if it fits the field's annotation (int, float, bool, str, dict, list[int], None)."""
    allowed = str(annotation).replace("<class '", "").replace("'>", "")  # e.g. "int | None", "bool"
    kinds = set(allowed.replace(" ", "").split("|"))
    ok = False
    if value is None:
        ok = "None" in kinds
    elif isinstance(value, bool):
        ok = "bool" in kinds
    elif isinstance(value, int):
        ok = "int" in kinds or ("float" in kinds and abs(value) < 1e300)   # float(10**400) overflows
        value = value if "int" in kinds or not ok else float(value)
    elif isinstance(value, float):
        ok = "float" in kinds and math.isfinite(value)
    elif isinstance(value, dict):
        ok = "dict" in kinds
    elif isinstance(value, str):
        ok = "str" in kinds
    elif isinstance(value, list):
        ok = ("list[int]" in kinds and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
              or "list[str]" in kinds and all(isinstance(v, str) for v in value))
    if not ok:
        raise NpqwenError(f"{source}: field {name!r} should be {allowed}, got {value!r}")
    return value


def _check_unsupported(raw: dict, source: str):
    """Qwen3 options that change the math and that npqwen does not implement."""
    if raw.get("hidden_act", "silu") != "silu":
        raise NpqwenError(f"{source}: hidden_act {raw['hidden_act']!r} is unsupported (Qwen3 uses 'silu')")
    if raw.get("attention_bias") and raw.get("qk_norm"):   # (Qwen2's q/k/v biases are read; see from_dict)
        raise NpqwenError(f"{source}: attention_bias true is unsupported (Qwen3 checkpoints have none)")
    if raw.get("partial_rotary_factor", 1.0) != 1.0 and not raw.get("hybrid"):
        raise NpqwenError(f"{source}: partial_rotary_factor is unsupported (Qwen3 rotates the whole head)")
    layer_types = [] if raw.get("hybrid") else raw.get("layer_types") or []
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise NpqwenError(f"{source}: sliding-window attention is unsupported (Qwen3 checkpoints use "
                          f"full attention: set use_sliding_window false)")


def _check_rope_scaling(scaling, max_position_embeddings):
    """Normalise rope_scaling to {"rope_type": ..., ...} and reject what npqwen cannot compute."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise NpqwenError(f"config: rope_scaling type {rope_type!r} is unsupported; npqwen computes "
                          f"{', '.join(ROPE_TYPES)} RoPE as transformers does")
    if rope_type == "default":
        return None
    if rope_type == "yarn":
        # As transformers: the pre-training length defaults to the context length, and a
        # missing factor is the ratio of the two.
        original = scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        if not isinstance(original, int) or original <= 0:
            raise NpqwenError(f"config: rope_scaling original_max_position_embeddings must be a positive "
                              f"integer, got {original!r}")
        if scaling.get("factor") is None:
            scaling["factor"] = max_position_embeddings / original
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise NpqwenError(f"config: rope_scaling type {rope_type!r} needs a positive 'factor', got {factor!r}")
    return {"rope_type": rope_type, **scaling}
