"""Bad Qwen3.5 input: an unknown layer type, head counts that do not divide, a missing or misshapen
linear-attention weight: each a clear NpqwenError naming the field or the weight (and both shapes)."""
import json

import numpy as np
import pytest

import npqwen
from npqwen import NpqwenError
from npqwen.config import Qwen3Config

from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_config

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def config(**overrides):
    raw = hybrid_config(**overrides)
    raw.pop("rope_parameters")
    return raw


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"]),
     r"layer_types holds 'sliding_attention', which npqwen does not know; each layer is one of full_attention, "
     r"linear_attention"),
    (dict(layer_types=["linear_attention", "full_attention"]), r"layer_types lists 2 layers but num_hidden_layers is 4"),
    (dict(layer_types=[1, 2, 3, 4]), r"field 'layer_types' should be list\[str\] \| None"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4),
     r"linear_num_value_heads \(4\) must be a multiple of linear_num_key_heads \(3\)"),
    (dict(linear_num_key_heads=0), r"linear_num_key_heads must be between 1 and"),
    (dict(num_attention_heads=3, num_key_value_heads=2), r"num_attention_heads \(3\) must be a multiple of "
                                                         r"num_key_value_heads \(2\)"),
    (dict(partial_rotary_factor=0.3), r"partial_rotary_factor 0.3 must be in \(0, 1\] and turn an even number"),
])
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(NpqwenError, match=message):
        Qwen3Config.from_dict(config(**overrides))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_errors"), hybrid_config())


def rewrite(checkpoint, tmp_path, change):
    """A copy of the checkpoint with its tensors changed by change(tensors)."""
    tensors = safetensors_numpy.load_file(checkpoint / "model.safetensors")
    change(tensors)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    return tmp_path


def test_a_missing_linear_attention_weight_is_named(checkpoint, tmp_path):
    path = rewrite(checkpoint, tmp_path, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(NpqwenError, match=r"tensor 'model.layers.1.linear_attn.A_log' is missing \(expected shape "
                                          r"\[4\]\)"):
        npqwen.load(path)


def test_a_misshapen_linear_attention_weight_names_both_shapes(checkpoint, tmp_path):
    def change(t):
        t["model.layers.2.linear_attn.conv1d.weight"] = np.zeros((96, 1, 3), np.float32)
    with pytest.raises(NpqwenError, match=r"tensor 'model.layers.2.linear_attn.conv1d.weight' has shape \[96, 1, 3\], "
                                          r"expected \[96, 1, 4\] from config.json"):
        npqwen.load(rewrite(checkpoint, tmp_path, change))


def test_a_gated_q_proj_of_the_wrong_size_names_the_field(checkpoint, tmp_path):
    raw = json.loads((checkpoint / "config.json").read_text())
    path = rewrite(checkpoint, tmp_path, lambda t: None)
    (path / "config.json").write_text(json.dumps({**raw, "num_attention_heads": 2, "num_key_value_heads": 2}))
    with pytest.raises(NpqwenError, match=r"config.json says num_attention_heads is 2 but "
                                          r"model.layers.3.self_attn.q_proj.weight has 256 rows"):
        npqwen.load(path)


def test_tensor_parallelism_refuses_sizes_that_do_not_split_the_linear_heads_and_says_why():
    """2 ranks split Hk=2 key heads and Hv=4 value heads; 4 ranks do not (the key heads), in Qwen3.5 and in the
    mixtures of experts (Qwen3.5-MoE, Qwen3-Next) alike."""
    from hybrid_checkpoints import hybrid_moe_config, qwen3_next_config

    from npqwen.parallel import check_split

    for raw in (config(), hybrid_moe_config(), qwen3_next_config()):
        raw.pop("rope_parameters", None)
        check_split(Qwen3Config.from_dict(raw), 2)
        with pytest.raises(NpqwenError, match=r"a tensor-parallel size of 4 does not split the model's 2 "
                                              r"linear-attention key heads \(linear_num_key_heads\) evenly; use a "
                                              r"size that divides both linear_num_key_heads \(2\) and "
                                              r"linear_num_value_heads \(4\)"):
            check_split(Qwen3Config.from_dict(raw), 4)
