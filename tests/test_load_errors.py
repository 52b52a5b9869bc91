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
    message = expect_error(lambda: npqwen.load(tmp_path / "nope"), "nope")
    assert "does not exist" in message or "no such directory" in message


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
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(model_type="qwen2_moe")))
    expect_error(lambda: npqwen.load(tmp_path), "model_type is 'qwen2_moe'", "'qwen3'", "'qwen3_moe'")


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
    expect_error(lambda: llm.forward([]), "empty")
    expect_error(lambda: llm.forward([[1, 2]]), "sequence")
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


# ---- safetensors headers: checked as the format defines them -------------------------------

def read_header(f):
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_raw_header(f, header_text: str, body: bytes):
    raw = header_text.encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def broken_copy(tmp_path, npqwen_tiny_dir, change):
    """A copy of the tiny checkpoint whose header dict went through `change(header) -> header or str`."""
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    header, body = read_header(f)
    header = change(header)
    write_raw_header(f, header if isinstance(header, str) else json.dumps(header), body)
    return tmp_path / "ckpt"


def set_entry(name, **fields):
    def change(header):
        header[name] = {**header[name], **fields}
        return header
    return change


NORM, K_NORM = "model.norm.weight", "model.layers.1.self_attn.k_norm.weight"   # (64,) and (32,) bf16


def share_range(header):
    """k_norm (64 bytes) also claims the first 64 bytes of model.norm.weight's range."""
    begin = header[NORM]["data_offsets"][0]
    header[K_NORM]["data_offsets"] = [begin, begin + 64]
    return header


BAD_HEADERS = {
    "negative begin": (set_entry(NORM, data_offsets=[-8, 120]), "data_offsets [-8, 120]"),
    "two tensors share bytes": (share_range, "overlaps"),
    "float end": (lambda h: set_entry(NORM, data_offsets=[h[NORM]["data_offsets"][0],
                                                          float(h[NORM]["data_offsets"][1])])(h), "data_offsets"),
    "string end": (lambda h: set_entry(NORM, data_offsets=[h[NORM]["data_offsets"][0],
                                                           str(h[NORM]["data_offsets"][1])])(h), "data_offsets"),
    "bool begin": (set_entry(NORM, data_offsets=[False, 128]), "data_offsets"),
    "three offsets": (set_entry(NORM, data_offsets=[0, 128, 256]), "data_offsets"),
    "dtype list": (set_entry(NORM, dtype=["F32"]), "unknown dtype ['F32']"),
    "dtype unknown": (set_entry(NORM, dtype="F33"), "unknown dtype 'F33'"),
    "shape negative": (set_entry(NORM, shape=[-64]), "shape [-64]"),
    "shape float": (set_entry(NORM, shape=[64.0]), "shape [64.0]"),
    "shape huge": (set_entry(NORM, shape=[2**62, 2**62, 2**62]), "needs more bytes"),
    "size disagrees": (set_entry(NORM, shape=[32]), "needs 64 bytes"),
    "entry not an object": (lambda h: {**h, NORM: [1, 2]}, "needs dtype, shape and data_offsets"),
    "entry lacks dtype": (lambda h: {**h, NORM: {k: v for k, v in h[NORM].items() if k != "dtype"}},
                          "needs dtype"),
    "gap between tensors": (lambda h: {k: v for k, v in h.items() if k != K_NORM}, "gap of 64 bytes"),
    "tail not described": (lambda h: {k: v for k, v in h.items() if k != NORM}, "128 bytes after the last"),
    "metadata not str": (lambda h: {"__metadata__": {"format": 1}, **h}, "__metadata__"),
    "header a list": (lambda h: "[1, 2]", "not a JSON object"),
    "duplicate name": (lambda h: json.dumps(h)[:-1] + f', "{NORM}": ' + json.dumps(h[NORM]) + "}",
                       "appears twice"),
    "deep nesting": (lambda h: "[" * 100_000 + "]" * 100_000, "corrupt safetensors header"),
    "5000-digit offset": (lambda h: json.dumps(h).replace(f"[0,", "[" + "9" * 5000 + ",", 1),
                          "corrupt safetensors header"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_bad_safetensors_header(tmp_path, npqwen_tiny_dir, case):
    change, fragment = BAD_HEADERS[case]
    ckpt = broken_copy(tmp_path, npqwen_tiny_dir, change)
    message = expect_error(lambda: npqwen.load(ckpt), "model.safetensors", fragment, "download")
    assert "\n" not in message and len(message) < 400


@pytest.mark.parametrize("header_length", [2**64 - 1, 2**40, 100 * 1024 * 1024 + 1])
def test_absurd_header_length_refused_before_reading(tmp_path, npqwen_tiny_dir, header_length):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    f.write_bytes(header_length.to_bytes(8, "little") + f.read_bytes()[8:])
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "not a safetensors file or truncated", "download")


def test_bytes_after_the_last_tensor(tmp_path, npqwen_tiny_dir):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 16)
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "16 bytes after the last tensor", "download")


def test_valid_variants_still_load(tmp_path, npqwen_tiny_dir):
    """Metadata, shuffled header order and a zero-size tensor are all valid safetensors."""
    def change(header):
        items = list(header.items())[::-1]
        end = header[NORM]["data_offsets"][1]
        zero = {"dtype": "I64", "shape": [0, 3], "data_offsets": [end, end]}   # unused, other dtype, empty
        return {"__metadata__": {"format": "pt"}, **dict(items), "extra.empty": zero}
    ckpt = broken_copy(tmp_path, npqwen_tiny_dir, change)
    with pytest.warns(UserWarning, match="extra.empty"):
        llm = npqwen.load(ckpt)
    np.testing.assert_array_equal(llm.forward([1, 2, 3]), npqwen.load(npqwen_tiny_dir).forward([1, 2, 3]))


def test_tensor_in_two_shards(tmp_path, npqwen_tiny_dir):
    from npqwen.checkpoint import save_safetensors

    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    save_safetensors(ckpt / "model-00002-of-00002.safetensors", {NORM: np.ones(64, np.float32)})
    weight_map = {NORM: "model-00002-of-00002.safetensors",
                  "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_error(lambda: npqwen.load(ckpt), f"'{NORM}' is in both", "download")


def test_unsupported_dtype_of_an_unused_tensor_is_ignored(tmp_path, npqwen_tiny_dir):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    header, body = read_header(f)
    header["step.counter"] = {"dtype": "I64", "shape": [2], "data_offsets": [len(body), len(body) + 16]}
    write_raw_header(f, json.dumps(header), body + np.arange(2, dtype=np.int64).tobytes())
    with pytest.warns(UserWarning, match="step.counter"):
        llm = npqwen.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(llm.forward([1]), npqwen.load(npqwen_tiny_dir).forward([1]))


# ---- config.json sizes against the tensors in the file ---------------------------------------

CONFIG_MISMATCHES = {
    "num_hidden_layers": (1_000_000_000, "num_hidden_layers is 1000000000", "3 layers"),
    "hidden_size": (128, "hidden_size is 128", "columns 64"),
    "vocab_size": (10**9, "vocab_size is 1000000000", "rows 512"),
    "intermediate_size": (2**31 - 1, "intermediate_size is 2147483647", "rows 96"),
    "head_dim": (16, "head_dim is 16", "size 32"),
    "num_attention_heads": (8, "num_attention_heads is 8", "128 rows"),
    "num_key_value_heads": (4, "num_key_value_heads is 4", "64 rows"),
}


@pytest.mark.parametrize("key", CONFIG_MISMATCHES)
def test_config_disagrees_with_tensors_fails_fast(tmp_path, npqwen_tiny_dir, key):
    """One line naming the key and both values, within a second, for load (generate) and describe (inspect)."""
    import time
    from npqwen.describe import describe

    value, *fragments = CONFIG_MISMATCHES[key]
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(tiny_config(**{key: value})))
    for run in (lambda: npqwen.load(tmp_path / "ckpt"), lambda: describe(str(tmp_path / "ckpt"))):
        start = time.perf_counter()
        message = expect_error(run, "config.json says", *fragments)
        assert time.perf_counter() - start < 1.0 and "\n" not in message


def test_absurd_layer_count_on_the_command_line(tmp_path, npqwen_tiny_dir):
    """`npqwen inspect` used to build a billion-entry table (6+ GB, no end); generate's load is timed above."""
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(tiny_config(num_hidden_layers=10**9)))
    result = subprocess.run([sys.executable, "-m", "npqwen", "inspect", "-m", str(tmp_path / "ckpt")],
                            capture_output=True, text=True, cwd=ROOT, timeout=30)
    print(result.stderr)
    assert result.returncode == 1 and "num_hidden_layers is 1000000000" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("text", ['{"hidden_size": ' + "9" * 5000 + "}", "[" * 100_000])
def test_config_json_that_python_cannot_parse(tmp_path, npqwen_tiny_dir, text):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(text)
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "config.json: not valid JSON")


def test_config_size_out_of_range(tmp_path, npqwen_tiny_dir):
    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(tiny_config(max_position_embeddings=10**30)))
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "max_position_embeddings must be between 1 and")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(tiny_config(rope_theta=10**400)))
    expect_error(lambda: npqwen.load(tmp_path / "ckpt"), "'rope_theta'")


# ---- tensors the config does not use: a warning, as transformers gives, and the load goes on ---

def test_unused_layers_and_stray_tensors_warn(tmp_path, npqwen_tiny_dir):
    from npqwen.checkpoint import read_safetensors_header, save_safetensors
    from npqwen.describe import describe

    shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    (ckpt / "config.json").write_text(json.dumps(tiny_config(num_hidden_layers=2)))
    with pytest.warns(UserWarning, match=r"11 tensors .* not used .*model\.layers\.2\.input_layernorm") as record:
        llm = npqwen.load(ckpt)
    assert len(record) == 1 and "... and 1 more" in str(record[0].message)
    assert llm.forward([1, 2]).shape == (2, 512)
    assert "not used by npqwen: model.layers.2." in describe(str(ckpt))

    # many stray names: the warning lists ten and counts the rest
    full = npqwen.load(npqwen_tiny_dir)
    tensors = {n: np.asarray(a) for n, a in full.weights.items() if n != "lm_head.weight"}
    tensors.update({f"vision.block.{i}.weight": np.zeros(2, np.float32) for i in range(50)})
    save_safetensors(ckpt / "model.safetensors", tensors)
    (ckpt / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.warns(UserWarning, match=r"50 tensors .*\.\.\. and 40 more") as record:
        npqwen.load(ckpt)
    assert len(str(record[0].message)) < 1000
    assert len(read_safetensors_header(ckpt / "model.safetensors")) == len(tensors)


def test_complete_checkpoint_gives_no_warning(npqwen_tiny_dir):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        npqwen.load(npqwen_tiny_dir)


@pytest.mark.parametrize("model, fragments", [
    (123, ["a model is a checkpoint directory (a str or a path)", "got int '123'"]),
    ("tinyy", ["no such directory: 'tinyy'", "did you mean 'tiny', the built-in model?"]),
    ("tiny-mo", ["did you mean 'tiny-moe'"]),
])
def test_a_model_that_is_no_path_or_a_mistyped_built_in_name_is_one_clear_error(model, fragments):
    """Before: load(123) was pathlib's TypeError; "tinyy" did not suggest "tiny"."""
    expect_error(lambda: npqwen.load(model), *fragments)
