"""Bad input while loading: each case raises NpqwenError with a message that says what is wrong."""
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import npqwen
from npqwen import NpqwenError

from conftest import ROOT, tiny_config, write_npqwen_checkpoint


def expect_error(fn, *fragments):
    with pytest.raises(NpqwenError) as info:
        fn()
    message = str(info.value)
    print(message)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_path_that_does_not_exist(tmp_path):
    expect_error(lambda: npqwen.load(tmp_path / "nope"), "does not exist", "nope")


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    expect_error(lambda: npqwen.load(tmp_path), "no model.safetensors")


def test_missing_config(tmp_path, npqwen_tiny_dir):
    shutil.copy(npqwen_tiny_dir / "model.safetensors", tmp_path)
    expect_error(lambda: npqwen.load(tmp_path), "config.json not found")


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_config_missing_field(tmp_path, field):
    config = tiny_config()
    del config[field]
    write_npqwen_checkpoint(tmp_path, tiny_config())
    (tmp_path / "config.json").write_text(json.dumps(config))
    expect_error(lambda: npqwen.load(tmp_path), f"required field {field!r} is missing")


def test_config_wrong_type(tmp_path):
    write_npqwen_checkpoint(tmp_path, tiny_config())
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(hidden_size="64")))
    expect_error(lambda: npqwen.load(tmp_path), "'hidden_size'", "'64'")
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(tie_word_embeddings=1)))
    expect_error(lambda: npqwen.load(tmp_path), "'tie_word_embeddings'", "bool")


def test_config_not_json(tmp_path):
    write_npqwen_checkpoint(tmp_path, tiny_config())
    (tmp_path / "config.json").write_text("{not json")
    expect_error(lambda: npqwen.load(tmp_path), "not valid JSON")


def test_config_of_another_model(tmp_path):
    write_npqwen_checkpoint(tmp_path, tiny_config())
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(model_type="qwen3_moe")))
    expect_error(lambda: npqwen.load(tmp_path), "model_type is 'qwen3_moe'", "qwen3")


@pytest.mark.parametrize("rope_type", ["dynamic", "llama3", "longrope", "su"])
def test_unknown_rope_type(tmp_path, rope_type):
    write_npqwen_checkpoint(tmp_path, tiny_config())
    config = tiny_config(rope_scaling={"rope_type": rope_type, "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    expect_error(lambda: npqwen.load(tmp_path), f"{rope_type!r} is unsupported")


def test_inconsistent_heads(tmp_path):
    write_npqwen_checkpoint(tmp_path, tiny_config())
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(num_key_value_heads=3)))
    expect_error(lambda: npqwen.load(tmp_path), "multiple of num_key_value_heads")


def test_missing_tensor(tmp_path):
    write_npqwen_checkpoint(tmp_path, tiny_config(), drop=("model.layers.1.self_attn.k_norm.weight",))
    expect_error(lambda: npqwen.load(tmp_path), "'model.layers.1.self_attn.k_norm.weight' is missing", "[32]")


def test_untied_checkpoint_without_lm_head(tmp_path):
    config = tiny_config(tie_word_embeddings=False)
    write_npqwen_checkpoint(tmp_path, config, drop=("lm_head.weight",))
    expect_error(lambda: npqwen.load(tmp_path), "'lm_head.weight' is missing", "[512, 64]")


def test_wrong_shape(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    write_npqwen_checkpoint(tmp_path, tiny_config(), reshape={name: (95, 64)})
    expect_error(lambda: npqwen.load(tmp_path), name, "[95, 64]", "expected [96, 64]")


@pytest.mark.parametrize("keep", [0, 5, 300, -100])
def test_truncated_safetensors(tmp_path, npqwen_tiny_dir, keep):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "model.safetensors", "download")


def test_corrupt_header(tmp_path, npqwen_tiny_dir):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"#!@$"
    f.write_bytes(bytes(data))
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "corrupt safetensors header")


def test_unsupported_dtype(tmp_path, npqwen_tiny_dir):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data.replace(b'"BF16"', b'"I16" ', 1))   # same length, so offsets stay valid
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "dtype I16", "BF16, F16 and F32")


def test_nan_weights(tmp_path):
    from npqwen.checkpoint import read_safetensors_header

    write_npqwen_checkpoint(tmp_path, tiny_config())
    f = tmp_path / "model.safetensors"
    info = read_safetensors_header(f)["model.norm.weight"]
    data = bytearray(f.read_bytes())
    data[info.start:info.start + 4] = np.float32(np.nan).tobytes()
    f.write_bytes(bytes(data))
    expect_error(lambda: npqwen.load(tmp_path), "'model.norm.weight' holds NaN", "corrupt")


def test_missing_shard(tmp_path, npqwen_tiny_dir):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "model.norm.weight": "model-00002-of-00002.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_error(lambda: npqwen.load(ckpt), "shard model-00002-of-00002.safetensors", "missing")


def test_bad_device_and_dtype(npqwen_tiny_dir):
    expect_error(lambda: npqwen.load(npqwen_tiny_dir, device="tpu"), "unknown device 'tpu'")
    expect_error(lambda: npqwen.load(npqwen_tiny_dir, dtype="float16"), "100x slower", "float32")
    expect_error(lambda: npqwen.load(npqwen_tiny_dir, dtype="int8"), "'int8' is not supported")


def test_bad_token_ids(npqwen_tiny_dir):
    llm = npqwen.load(npqwen_tiny_dir)
    expect_error(lambda: llm.forward([1, 2, 512]), "token id 512", "0 .. 511")
    expect_error(lambda: llm.forward([-1]), "token id -1")
    expect_error(lambda: llm.forward([]), "non-empty")
    expect_error(lambda: llm.forward([[1, 2]]), "1-D")
    expect_error(lambda: llm.forward([1.5]), "integers")
    expect_error(lambda: llm.forward(list(range(1, 3)) * 300), "600 positions", "context")
    cache = llm.new_cache(8)
    llm.forward([1, 2, 3, 4, 5], cache=cache)
    expect_error(lambda: llm.forward([1, 2, 3, 4], cache=cache), "9 positions", "KV cache of 8")
    expect_error(lambda: llm.new_cache(10_000), "exceeds the model's context of 512")


def test_runs_without_torch(npqwen_tiny_dir):
    """Loading and a forward pass never import torch or transformers (they are blocked here)."""
    script = textwrap.dedent(f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "safetensors"):
                    raise ImportError("blocked by the test: " + name)
        sys.meta_path.insert(0, Block())
        import npqwen, npqwen.cli
        llm = npqwen.load({str(npqwen_tiny_dir)!r})
        logits = llm.forward([1, 2, 3])
        assert logits.shape == (3, 512), logits.shape
        assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
        print("ok without torch")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    print(result.stdout, result.stderr)
    assert result.returncode == 0 and "ok without torch" in result.stdout


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_activation_keeps_the_compute_dtype(npqwen_tiny_dir, dtype):
    """No float64 creeps into a float32 forward (NumPy 2 promotes on np.float64 scalars), nor the reverse."""
    llm = npqwen.load(npqwen_tiny_dir, dtype=dtype)
    seen = {}
    cache = llm.new_cache(16)
    for ids in ([5, 6, 7, 8], [9]):   # a prefill and a one-token decode step
        llm.forward(ids, cache=cache, recorder=lambda name, a: seen.setdefault(name, set()).add(a.dtype))
    assert len(seen) > 20
    wrong = {name: dtypes for name, dtypes in seen.items() if dtypes != {np.dtype(dtype)}}
    assert not wrong, f"activations not in {dtype}: {wrong}"
    assert all(w.dtype == np.dtype(dtype) for w in llm.weights.values())


def test_float16_compute_path_runs_on_numpy():
    """The float16 path CuPy uses (norms and softmax in float32, activations in float16), run with NumPy."""
    from npqwen.tiny import tiny_model

    half, full = tiny_model(dtype="float16"), tiny_model(dtype="float32")
    ids = list(range(60, 90))
    seen = set()
    logits = half.forward(ids, recorder=lambda name, a: seen.add(a.dtype))
    assert seen == {np.dtype(np.float16)} and logits.dtype == np.float16
    err = np.abs(logits.astype(np.float32) - full.forward(ids)).max()
    print("float16 vs float32 max |logit diff|", err)
    assert err < 0.05
