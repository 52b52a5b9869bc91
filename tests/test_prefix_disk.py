"""The prefix cache's disk tier (--prefix-cache-dir, npqwen/engine/prefix_disk.py): after a restart the same
long prompt reaches its first token from the files in under a fifth of the first start's time, with the same
token; a damaged file, another model's file and junk under a page's name are ignored with a warning (and the
prompt computed again); the folder stays under its size; hybrid models and bad values get one clear error."""
import json
import shutil
import time
import warnings

import numpy as np
import pytest

import npqwen
from npqwen import Engine, NpqwenError
from npqwen.engine.prefix_disk import SUFFIX, PrefixWarning

from conftest import tiny_config, write_npqwen_checkpoint

P = 256
PROMPT = np.random.default_rng(0).integers(0, 512, 4 * P + 1).tolist()   # 4 full pages, then the token that samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Wide enough that a 1,025-token prefill is measurably slower than reading its 4 pages (1 MB) from files."""
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("prefix_disk"), tiny_config(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2, max_position_embeddings=2048))


def first_token(model_dir, folder, **engine) -> tuple[float, int, Engine]:
    """Load the model afresh (a restart), make an engine on `folder`, time the prompt to its first token."""
    engine = Engine(npqwen.load(model_dir), kv_cache_tokens=2048, page_size=P, prefix_cache_dir=folder, **engine)
    start = time.perf_counter()
    engine.add_request(PROMPT, max_new_tokens=1, temperature=0)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
        engine.check()
    return time.perf_counter() - start, tokens[0], engine


@pytest.fixture(scope="module")
def first_start(model_dir, tmp_path_factory):
    """The first start: nothing on disk; the prompt's 4 full pages are written."""
    folder = tmp_path_factory.mktemp("kv_pages")
    seconds, token, engine = first_token(model_dir, folder)
    assert engine.cache.disk.saved_pages == 4 and len(list(folder.glob(f"*{SUFFIX}"))) == 4
    return folder, seconds, token


def test_a_restart_reads_the_prompt_from_disk(model_dir, first_start, tmp_path):
    folder, cold, token = first_start
    shutil.copytree(folder, tmp_path / "kv", dirs_exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrefixWarning)
        warm, again, engine = first_token(model_dir, tmp_path / "kv")
    print(f"first token: {cold:.3f} s at the first start, {warm:.3f} s after a restart ({cold / warm:.1f}x)")
    assert engine.cache.disk.loaded_pages == 4 and engine.cache.hit_tokens == 4 * P
    assert again == token, f"the first token after a restart {again} != {token} computed"
    assert warm < cold / 5, f"after a restart {warm:.3f} s, not under a fifth of the first start's {cold:.3f} s"


def test_damaged_foreign_and_junk_files_are_ignored(model_dir, first_start, tmp_path):
    folder, _, token = first_start
    kv = tmp_path / "kv"
    shutil.copytree(folder, kv)
    keys = Engine(npqwen.load(model_dir), kv_cache_tokens=2048, page_size=P, prefix_cache_dir=kv).cache.disk.keys(
        PROMPT, 4, P)
    page = [kv / (key + SUFFIX) for key in keys]

    def damage(path):   # a byte of the last layer's values flipped
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))

    def foreign(path):   # sound, but written for another model (another key in its header)
        header, payload = path.read_bytes().split(b"\n", 1)
        header = json.loads(header)
        header["model"] = "0" * 64
        path.write_bytes(json.dumps(header).encode() + b"\n" + payload)

    for i, problem, spoil in ((3, "damaged", damage), (2, "cannot be read", lambda p: p.write_bytes(b"junk\n\x00")),
                              (1, "another model", foreign)):
        spoil(page[i])
        with pytest.warns(PrefixWarning, match=problem):
            _, again, engine = first_token(model_dir, kv)
        print(f"page {i + 1} {problem}: {engine.cache.disk.loaded_pages} pages read, the rest computed")
        assert engine.cache.disk.loaded_pages == i and again == token
        assert engine.cache.disk.saved_pages == 1   # the page ignored is written again, sound; the others are there


def test_the_folder_stays_under_its_size(model_dir, tmp_path):
    page_bytes = 2 * 2 * 2 * P * 32 * 4    # keys + values, 2 layers, 2 kv heads, P positions of 32 float32
    _, _, engine = first_token(model_dir, tmp_path / "kv", prefix_cache_dir_size=2.5 * page_bytes / 1e9)
    files = sorted((tmp_path / "kv").glob(f"*{SUFFIX}"))
    keys = engine.cache.disk.keys(PROMPT, 4, P)
    assert [f.stem for f in files] == sorted(keys[2:]), "not the two most recently written pages"
    assert sum(f.stat().st_size for f in files) < 2.5 * page_bytes + 4096


def test_bad_values_and_hybrid_models_are_refused(tmp_path):
    llm = npqwen.load("tiny")
    with pytest.raises(NpqwenError, match="prefix_cache_dir_size must be"):
        Engine(llm, kv_cache_tokens=512, prefix_cache_dir=tmp_path, prefix_cache_dir_size=0)
    with pytest.raises(NpqwenError, match="needs the prefix cache"):
        Engine(llm, kv_cache_tokens=512, prefix_cache_dir=tmp_path, prefix_cache=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(NpqwenError, match="cannot use it as the prefix cache's folder"):
        Engine(llm, kv_cache_tokens=512, prefix_cache_dir=tmp_path / "file")
    with pytest.raises(NpqwenError, match="hybrid models"):
        Engine(npqwen.load("tiny-qwen3.5"), kv_cache_tokens=512, prefix_cache_dir=tmp_path)
    with pytest.raises(NpqwenError, match="kv_cache_dtype must be one of"):
        Engine(llm, kv_cache_tokens=512, kv_cache_dtype="fp8")
