"""Random-weight Qwen3.5 checkpoints written by transformers, and HF's model as the golden reference."""
import json
from pathlib import Path

from npqwen.config import QWEN3_5_0_8B_TEXT_CONFIG

# Qwen3.5 at a small size: 4 layers (3 linear, 1 full), uneven head counts, partial rotary 0.25
TINY_HYBRID = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                   max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                    "mrope_section": [1, 1, 2], "mrope_interleaved": True})

# Qwen/Qwen3.5-0.8B's text model (its config.json's text_config), with `num_hidden_layers` set by the test
QWEN3_5_0_8B_TEXT = {k: v for k, v in QWEN3_5_0_8B_TEXT_CONFIG.items()
                     if k not in ("architectures", "model_type", "layer_types")}


# Qwen3.5-MoE at the tiny size: 8 experts of width 16, 2 per token, a shared expert of width 24
TINY_HYBRID_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24)

# Qwen/Qwen3.5-35B-A3B's text model (a layer's shape: 256 experts of 512, 8 per token, shared expert of 512)
QWEN3_5_35B_A3B_TEXT = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
    rms_norm_eps=1e-6, tie_word_embeddings=False, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def hybrid_moe_config(**overrides) -> dict:
    cfg = {k: v for k, v in TINY_HYBRID.items() if k != "intermediate_size"}
    return {"model_type": "qwen3_5_moe_text", **cfg, **TINY_HYBRID_MOE, **overrides}


def qwen3_next_config(**overrides) -> dict:
    """Qwen3-Next at the tiny size: layer 1 keeps a dense MLP (mlp_only_layers), the others are sparse."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}   # no multimodal layout
    return {"model_type": "qwen3_next", **TINY_HYBRID, **TINY_HYBRID_MOE, "mlp_only_layers": [1],
            "rope_parameters": rope, **overrides}


def hybrid_config(**overrides) -> dict:
    return {"model_type": "qwen3_5_text", **TINY_HYBRID, **overrides}


def hf_hybrid_classes(model_type: str):
    import transformers

    return {"qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
            "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
            "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
            "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
            "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
            }[model_type]


def randomize(model, seed: int, std: float, stds: dict | None = None):
    """Random weights that make every part show: the (1 + weight) norms get noise around 0, the gated norm
    around 1, the convolution a larger spread; A_log and dt_bias keep HF's initial values. `stds`: {name
    suffix: std} for the matrices that take another spread (the first suffix that matches)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
            elif not name.endswith(("A_log", "dt_bias")):
                p.normal_(0.0, next((s for suffix, s in (stds or {}).items() if name.endswith(suffix)), std))


def build_hybrid_checkpoint(path: Path, config: dict, save_dtype: str = "float32", seed: int = 0,
                            std: float = 0.05, hub_layout: bool = False, top_level: dict | None = None,
                            stds: dict | None = None) -> Path:
    """Save a random Qwen3_5ForCausalLM (or, with hub_layout, a Qwen3_5ForConditionalGeneration around it:
    text_config, model.language_model.*, a small vision tower) with transformers' save_pretrained. The hub
    layout's top-level config takes `top_level` (default: the text config's tie_word_embeddings). `stds`: as
    for randomize."""
    import torch

    torch.manual_seed(seed)
    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    text_type = config.get("model_type", "qwen3_5_text")
    text_config_class, text_class = hf_hybrid_classes(text_type)
    if hub_layout:
        config_class, model_class = hf_hybrid_classes(text_type.removesuffix("_text"))
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=cfg["hidden_size"],
                      patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
        top = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False)} if top_level is None else top_level
        model = model_class(config_class(text_config=text_config_class(**cfg).to_dict(), vision_config=vision, **top))
    else:
        model = text_class(text_config_class(**cfg))
    randomize(model, seed, std, stds)
    model.to(getattr(torch, save_dtype)).save_pretrained(path)
    return Path(path)


def hf_hybrid_model(path: Path):
    """transformers loading the same directory in float32."""
    import torch

    model_class = hf_hybrid_classes(json.loads((Path(path) / "config.json").read_text())["model_type"])[1]
    return model_class.from_pretrained(path, dtype=torch.float32).eval()
