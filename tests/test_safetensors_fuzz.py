"""Broken safetensors files, built at random from a valid tiny checkpoint (fixed seed).

Each must either load to exactly the original logits or be refused with NpqwenError:
never another exception, a hang, or a silently different model.
"""
import json
import random
import shutil
import time
import warnings

import numpy as np
import pytest

import npqwen
from npqwen import NpqwenError

from conftest import tiny_config, write_npqwen_checkpoint

SEED = 1234
IDS = [1, 7, 42, 300]


def split(data: bytes):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header, body: bytes) -> bytes:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def odd_value(rng: random.Random, near: int):
    """Something that is not quite a valid offset or dimension."""
    return rng.choice([-1, -8, near + 1, near - 1, 2 * near, float(near), str(near), True, False, None,
                       [near], {"v": near}, 2**63, 2**64 + near, 10**40, -(2**63), 0])


def header_mutation(rng: random.Random, header: dict):
    """One random change to the parsed header; returns (header or raw JSON text, what changed)."""
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    entry = dict(header[name])
    begin, end = entry["data_offsets"]
    kind = rng.choice(["begin", "end", "both", "dtype", "shape", "drop_key", "entry", "duplicate",
                       "swap_ranges", "metadata", "rename", "extra"])
    if kind == "begin":
        entry["data_offsets"] = [odd_value(rng, begin), end]
    elif kind == "end":
        entry["data_offsets"] = [begin, odd_value(rng, end)]
    elif kind == "both":
        shift = rng.choice([-4, 4, 8, -begin - 8, 1 << 20])
        entry["data_offsets"] = [begin + shift, end + shift]
    elif kind == "dtype":
        entry["dtype"] = rng.choice(["F16", "BF16", "F64", "I16", "U8", "I64", "f32", "", "F32 ", None, 4,
                                     ["F32"], {"F32": 1}, "F8_E4M3", "F4"])
    elif kind == "shape":
        shape = list(entry["shape"])
        entry["shape"] = rng.choice([[], [0], shape[::-1], shape + [1], [1] + shape, [-d for d in shape],
                                     [float(d) for d in shape], [str(d) for d in shape], [True] * len(shape),
                                     [2**63] * 3, [10**30, 0], shape[:1], None, "x"])
    elif kind == "drop_key":
        del entry[rng.choice(["dtype", "shape", "data_offsets"])]
    elif kind == "entry":
        entry = rng.choice([None, [], "F32", 7, [entry["dtype"], entry["shape"]], {}])
    elif kind == "duplicate":
        other = rng.choice(names)
        text = json.dumps(header)[:-1] + f", {json.dumps(other)}: {json.dumps(header[other])}}}"
        return text, f"duplicate {other}"
    elif kind == "swap_ranges":   # give name the byte range of a tensor of another size, or share one
        other = header[rng.choice(names)]
        entry["data_offsets"] = list(other["data_offsets"])
    elif kind == "metadata":
        header = {"__metadata__": rng.choice([{"format": 1}, ["pt"], "pt", {"a": None}, {"format": "pt"}]),
                  **header}
    elif kind == "rename":
        header = {("x" + n if n == name else n): v for n, v in header.items()}
        return header, f"rename {name}"
    elif kind == "extra":
        entry["extra_field"] = rng.choice([1, "x", None])
    header = dict(header)
    header[name] = entry
    return header, f"{kind} {name}: {json.dumps(entry)[:120]}"


def byte_mutation(rng: random.Random, data: bytes, n: int):
    """One random change to the raw bytes of the file; returns (bytes, what changed)."""
    kind = rng.choice(["truncate", "flip_header", "garbage_header", "length", "append", "huge_length"])
    if kind == "truncate":
        keep = rng.choice([0, 3, 8, 9, n // 2, n + 7, n + 8, len(data) - 1, len(data) - 64])
        return data[:keep], f"truncate to {keep}"
    if kind == "flip_header":
        out = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(8, 8 + n)
            out[at] = rng.randrange(256)
        return bytes(out), "flip header bytes"
    if kind == "garbage_header":
        at, width = rng.randrange(8, 8 + n), rng.randint(1, 64)
        garbage = bytes(rng.randrange(256) for _ in range(width))
        return data[:at] + garbage[:max(0, 8 + n - at)] + data[at + len(garbage[:max(0, 8 + n - at)]):], \
            "garbage in header"
    if kind == "length":
        new = rng.choice([0, 1, n - 1, n + 1, n + 8, len(data) - 8, len(data)])
        return new.to_bytes(8, "little") + data[8:], f"header length {new}"
    if kind == "append":
        return data + bytes(rng.randint(1, 64)), "bytes appended"
    new = rng.choice([2**64 - 1, 2**63, 2**40, 100 * 1024 * 1024 + 1])
    return new.to_bytes(8, "little") + data[8:], f"huge header length {new}"


def relayout(rng: random.Random, header: dict, body: bytes):
    """A valid rewrite: tensors stored in another order, header keys shuffled, metadata added."""
    names = list(header)
    order = names[:]
    rng.shuffle(order)
    new_body, new_header, at = b"", {"__metadata__": {"format": "pt"}}, 0
    for name in order:
        begin, end = header[name]["data_offsets"]
        new_body += body[begin:end]
        new_header[name] = {**header[name], "data_offsets": [at, at + end - begin]}
        at += end - begin
    rng.shuffle(names)
    return {"__metadata__": new_header.pop("__metadata__"), **{n: new_header[n] for n in names}}, new_body


def cases(data: bytes, count: int):
    rng = random.Random(SEED)
    header, body = split(data)
    n = int.from_bytes(data[:8], "little")
    for i in range(count):
        roll = rng.random()
        if roll < 0.55:
            mutated, what = header_mutation(rng, json.loads(json.dumps(header)))
            yield join(mutated, body), what
        elif roll < 0.9:
            yield byte_mutation(rng, data, n)
        else:
            yield join(*relayout(rng, header, body)), "valid relayout"


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = write_npqwen_checkpoint(tmp_path_factory.mktemp("fuzz_src"), tiny_config(num_hidden_layers=2),
                                   dtype="BF16")
    return path, npqwen.load(path).forward(IDS)


def test_fuzzed_safetensors_load_exactly_or_are_refused(tmp_path, original):
    source, expected = original
    data = (source / "model.safetensors").read_bytes()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    outcomes = {"loaded": 0, "refused": 0}
    start = time.perf_counter()
    for i, (broken, what) in enumerate(cases(data, 160)):
        (ckpt / "model.safetensors").write_bytes(broken)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # stray names warn; test_load_errors.py tests that
                llm = npqwen.load(ckpt)
        except NpqwenError as e:
            message = str(e)
            assert "\n" not in message and str(ckpt) in message and len(message) < 600, \
                f"case {i} ({what}): {message!r}"
            outcomes["refused"] += 1
            continue
        except Exception as e:   # noqa: BLE001  the point of the test
            pytest.fail(f"case {i} ({what}): {type(e).__name__}: {e}")
        got = llm.forward(IDS)
        assert np.array_equal(got, expected), f"case {i} ({what}) loaded but gives other logits"
        outcomes["loaded"] += 1
    print(outcomes, f"{time.perf_counter() - start:.2f}s")
    assert outcomes["loaded"] >= 5 and outcomes["refused"] >= 100   # both paths are exercised

