"""device="cuda" without a GPU: the real CuPy code path runs on a strict stand-in (tests/strict_cupy.py).

Every test here sees `cupy` as the stand-in (installed for this module only, so the GPU tests
elsewhere still skip without a GPU). On it: logits and hidden states equal HF transformers' as
on the CPU, greedy and sampled tokens equal the CPU's, the engine moves only the sampled logits
rows to the host, loading uploads each weight once without a second host copy, every cupy name
and keyword used exists in the real cupy package, and each kind of CuPy failure the stand-in
models is seen to bite.
"""
import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import npqwen
import strict_cupy
from npqwen import Engine, NpqwenError
from npqwen.backend import cuda_available

from conftest import build_hf_checkpoint, hf_model, tiny_config, tiny_moe_config, write_npqwen_checkpoint

# float16 logits vs HF float32: float16 rounds each layer's output to eps16 = 9.8e-4 of it; over 2-3 layers and the
# lm_head, at |logits| < 2, about 4 * 9.8e-4 * 2 = 7.8e-3 (measured: at most 3.2e-3)
FLOAT16_LOGIT_TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def cupy():
    """`import cupy` gives the stand-in for every test of this module, and only here."""
    with pytest.MonkeyPatch.context() as mp:
        yield strict_cupy.install(mp)


@pytest.fixture
def planted():
    """For tests that use the stand-in wrongly on purpose: what they ask for is not kept as 'used'."""
    before = {name: set(keywords) for name, keywords in strict_cupy.used.items()}
    yield
    strict_cupy.used.clear()
    strict_cupy.used.update(before)


def on_device(a) -> bool:
    return isinstance(a, strict_cupy.ndarray)


# --- the golden tests of the CPU, on device cuda --------------------------------------------------------


@pytest.mark.parametrize("case", ["tiny-gqa2-bf16-tied", "gqa1-f32-untied-sharded", "gqa4-bf16-untied-sharded",
                                  "gqa2-f16-untied", "yarn-bf16", "linear-rope-f32"])
def test_logits_match_hf(case, tmp_path):
    from test_forward_golden import CASES, compare

    overrides, save_dtype, shard, T = CASES[case]
    path = build_hf_checkpoint(tmp_path, tiny_config(**overrides), save_dtype=save_dtype, shard=shard)
    llm = npqwen.load(path, device="cuda")
    assert all(on_device(a) for a in llm.weights.values())
    ids = np.random.default_rng(1).integers(0, llm.config.vocab_size, size=T)
    compare(llm, hf_model(path), ids, "cuda")


def test_qwen3_0_6b_shape_matches_hf(qwen3_0_6b_shape):
    """The exact Qwen3-0.6B shape (random bf16 weights), float32 on the device, as test_forward_golden."""
    from test_forward_golden import compare

    llm = npqwen.load(qwen3_0_6b_shape, device="cuda")
    assert llm.weights["lm_head.weight"] is llm.weights["model.embed_tokens.weight"]
    ids = np.random.default_rng(2).integers(0, 151_643, size=24)
    compare(llm, hf_model(qwen3_0_6b_shape), ids, "cuda")


@pytest.mark.parametrize("case", ["tiny-gqa2-bf16-tied", "gqa4-bf16-untied-sharded", "yarn-bf16"])
def test_float16_logits_near_hf(case, tmp_path):
    """dtype="float16" (cuda only) computes in float16 throughout; its logits stay near HF's float32 ones."""
    import torch

    from test_forward_golden import CASES

    overrides, save_dtype, shard, T = CASES[case]
    path = build_hf_checkpoint(tmp_path, tiny_config(**overrides), save_dtype=save_dtype, shard=shard)
    llm = npqwen.load(path, device="cuda", dtype="float16")
    assert {a.dtype for a in llm.weights.values()} == {np.dtype(np.float16)}
    ids = np.random.default_rng(1).integers(0, llm.config.vocab_size, size=T)
    logits = llm.forward(ids)
    assert on_device(logits) and logits.dtype == np.float16
    with torch.no_grad():
        want = hf_model(path)(torch.tensor(ids)[None]).logits[0].numpy()
    diff = np.abs(logits.get().astype(np.float32) - want)
    print(f"{case} float16: max |logit diff| {diff.max():.3e} (max |logit| {np.abs(want).max():.2e})")
    assert diff.max() <= FLOAT16_LOGIT_TOL


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """The HF-written tiny checkpoint of the greedy golden test and its transformers model."""
    path = build_hf_checkpoint(tmp_path_factory.mktemp("cuda_gen_tiny"), tiny_config(max_position_embeddings=1024),
                               std=0.1)
    return path, hf_model(path)


@pytest.mark.parametrize("length", [1, 37, 600])   # 600 crosses a prefill chunk boundary (512)
def test_greedy_equals_hf(tiny_hf, length):
    from test_generate_golden import check_greedy

    path, ref = tiny_hf
    llm = npqwen.load(path, device="cuda")
    check_greedy(llm, ref, np.random.default_rng(length).integers(0, 512, size=length).tolist())


def test_kv_cache_decode_equals_full_recompute(tiny_hf):
    from test_generate_golden import check_cache_equals_recompute

    llm = npqwen.load(tiny_hf[0], device="cuda")
    check_cache_equals_recompute(llm, np.random.default_rng(3).integers(0, 512, size=40).tolist(), chunk=7)


@pytest.mark.parametrize("case", ["top2-norm-tied-bf16", "top5of12-unnormed-dense-layer1", "top3-norm-sparse-step2"])
def test_moe_logits_match_hf(case, tmp_path):
    """Qwen3-MoE on device cuda: logits, hidden states and the router's choices equal HF's, as on the CPU."""
    from test_moe import check_against_hf, hf_forward, moe_checkpoint

    path = moe_checkpoint(tmp_path, case)
    llm, ref = npqwen.load(path, device="cuda"), hf_model(path)
    assert any("experts" in n for n in llm.model.fused) and all(on_device(a) for a in llm.model.fused.values())
    for T in (1, 300):
        ids = np.random.default_rng(T).integers(0, 512, size=T)
        check_against_hf(llm, ids, hf_forward(ref, ids))


def test_moe_greedy_float16_and_engine(tmp_path):
    """Qwen3-MoE on device cuda: greedy equals HF generate, float16 logits stay near HF's float32 ones, and the
    engine's batched tokens equal the CPU's."""
    import torch

    from npqwen.trace import Trace
    from test_engine import prompts, run
    from test_generate_golden import check_greedy
    from test_moe import moe_checkpoint

    path = moe_checkpoint(tmp_path, "top2-norm-tied-bf16", mlp_only_layers=[1])
    ref = hf_model(path)
    check_greedy(npqwen.load(path, device="cuda"), ref, np.random.default_rng(2).integers(0, 512, size=37).tolist())
    # float16 rounds the router's logits by ~1e-3 of their size: a token whose 2nd and 3rd experts are
    # closer than that may go to the other one (so would HF's in float16), which changes everything after
    # it. So the prompt is cut before the first token whose float32 margin is under 0.01.
    ids = np.random.default_rng(1).integers(0, 512, size=80)
    trace = Trace()
    npqwen.load(path, device="cuda").forward(ids, recorder=trace)
    ranked = np.sort(trace["model.layers.0.mlp.gate"], axis=-1)               # (T, E)
    close = np.flatnonzero(ranked[:, -2] - ranked[:, -3] < 0.01)
    ids = ids[:close[0] if close.size else len(ids)]
    with torch.no_grad():
        out = ref(torch.tensor(ids)[None], output_router_logits=True)
    trace = Trace()
    half = npqwen.load(path, device="cuda", dtype="float16").forward(ids, recorder=trace)
    diff = np.abs(half.get().astype(np.float32) - out.logits[0].numpy())
    print(f"MoE float16, {len(ids)} tokens: max |logit diff| {diff.max():.3e}")
    hf_top = torch.topk(out.router_logits[0], 2, -1).indices.numpy()
    assert len(ids) >= 20 and (trace["model.layers.0.mlp.gate.top_k_index"] == hf_top).all()
    assert half.dtype == np.float16 and diff.max() <= FLOAT16_LOGIT_TOL
    results = []
    for device in ("cpu", "cuda"):
        requests = [(p, dict(max_new_tokens=6, temperature=0)) for p in prompts([1, 17, 300], seed=4)]
        engine = Engine(npqwen.load(path, device=device), kv_cache_tokens=2048, page_size=16, max_batched_tokens=64)
        results.append(run(engine, requests, spy=True))
    for (want_tokens, want_logits, _), (got, got_logits, _) in zip(*results):
        # the stand-in runs NumPy's float32 kernels on the same sums in the same order: exactly the CPU's
        assert got == want_tokens and all(np.array_equal(a, b) for a, b in zip(got_logits, want_logits))


# --- sampling and the engine: the same tokens as on the CPU ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny bf16 checkpoint written without torch."""
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("cuda_tiny"), tiny_config(max_position_embeddings=1024),
                                   dtype="BF16")


@pytest.fixture(scope="module")
def cpu_and_cuda(tiny_dir):
    return npqwen.load(tiny_dir, device="cpu"), npqwen.load(tiny_dir, device="cuda")


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=40, top_p=0.9, seed=7),
                                      dict(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=11)])
def test_sampling_equals_cpu(cpu_and_cuda, sampling):
    cpu, cuda = cpu_and_cuda
    prompt = np.random.default_rng(5).integers(0, 512, size=23).tolist()
    want = cpu.generate(prompt, max_new_tokens=24, **sampling).token_ids
    got = cuda.generate(prompt, max_new_tokens=24, **sampling).token_ids
    print(f"cpu {want}\ncuda {got}")
    assert got == want and len(got) == 24


def test_builtin_tiny_model_equals_cpu(cupy, tmp_path):
    """npqwen.load("tiny", device="cuda") fills the same random weights as on the CPU and greedy-decodes alike;
    token ids may be a device array; llm.save writes the device weights (each downloaded once)."""
    cpu, cuda = npqwen.load("tiny"), npqwen.load("tiny", device="cuda")
    assert all(on_device(cuda.weights[n]) and (cuda.weights[n].get() == a).all() for n, a in cpu.weights.items())
    assert (cuda.generate("Hello", max_new_tokens=8, temperature=0).token_ids
            == cpu.generate("Hello", max_new_tokens=8, temperature=0).token_ids)
    assert (cuda.forward(cupy.asarray(np.arange(5))).get() == cpu.forward(list(range(5)))).all()
    strict_cupy.transfers.reset()
    cuda.save(tmp_path)
    assert strict_cupy.transfers.to_host_bytes == device_bytes(cuda)
    saved = npqwen.load(tmp_path)
    assert all((saved.weights[n] == a).all() for n, a in cpu.weights.items())


def test_npqwen_compare_on_cuda(tiny_hf):
    """`npqwen compare` (every traced step vs HF's hooks) runs on a device model, every step within 1e-3."""
    from npqwen.compare import compare

    llm = npqwen.load(tiny_hf[0], device="cuda")
    rows = compare(llm, np.random.default_rng(9).integers(0, 512, size=21).tolist())
    bad = [r for r in rows if not r["ok"]]
    assert len(rows) > 50 and not bad, bad


def test_engine_equals_cpu(cpu_and_cuda):
    """Several prompts at once (chunked prefill, batched decode, one sampled): tokens and logits as on the CPU."""
    from test_engine import prompts, run

    results = []
    for llm in cpu_and_cuda:
        requests = [(p, dict(max_new_tokens=9, temperature=0)) for p in prompts([1, 5, 17, 64, 300], seed=4)]
        requests.append((prompts([12], seed=6)[0], dict(max_new_tokens=9, temperature=0.9, top_k=20, seed=3)))
        engine = Engine(llm, kv_cache_tokens=4096, page_size=16, max_batched_tokens=128)
        results.append(run(engine, requests, spy=True))
    for (want, want_logits, _), (got, got_logits, _) in zip(*results):
        err = max(float(np.abs(a - b).max()) for a, b in zip(got_logits, want_logits))
        print(f"{len(got)} tokens, equal: {got == want}, max |logit diff| {err:.1e}")
        assert got == want and err == 0   # the stand-in: NumPy's float32 kernels on the same sums in the same order


# --- what crosses between host and device -----------------------------------------------------------------


class BatchSpy:
    """Wraps the model so a test sees each step's Batch."""

    def __init__(self, model):
        self.model, self.batch = model, None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_batch(self, batch, kv, recorder=None):
        self.batch = batch
        return self.model.forward_batch(batch, kv, recorder)


def test_a_step_moves_only_the_sampled_logits_to_the_host(cpu_and_cuda):
    """Per engine step: one device->host copy, exactly the logits rows that sample (never the KV cache or the
    weights); host->device only the step's small int64 index arrays, counted here exactly."""
    llm = cpu_and_cuda[1]
    V, K, L = llm.config.vocab_size, llm.config.num_key_value_heads, llm.config.num_hidden_layers
    itemsize = llm.model.dtype.itemsize
    engine = Engine(llm, kv_cache_tokens=4096, page_size=16, max_batched_tokens=64)
    engine.model = spy = BatchSpy(engine.model)
    for n in (40, 100, 7):
        engine.add_request(np.random.default_rng(n).integers(0, 512, size=n).tolist(), max_new_tokens=6,
                           temperature=0.7, seed=n)
    seen = {"prefill": [], "decode": []}
    while engine.has_unfinished():
        strict_cupy.transfers.reset()
        outputs = engine.step()
        t, batch = strict_cupy.transfers, spy.batch
        rows, T = sum(1 for o in outputs if o.token_ids), len(batch.token_ids)
        kind = "decode" if max(batch.lengths) == 1 else "prefill"
        seen[kind].append((T, rows, t.to_host, t.to_host_bytes, t.to_device, t.to_device_bytes))
        assert t.to_host == 1 and t.to_host_bytes == rows * V * itemsize, (kind, t)
        # up, as int64: token ids, positions, K cache slots per token; the sampled rows when not all rows sample;
        # the decoding rows, once per layer (Qwen3.self_attn uploads them where it uses them)
        B, D = len(batch.sample_rows), len(batch.decode_rows)
        subset = B < T
        assert t.to_device == 3 + subset + L * (D > 0), (kind, t)
        assert t.to_device_bytes == 8 * (T * (2 + K) + subset * B + L * D), (kind, t)
    for kind, steps in seen.items():
        print(f"{kind} steps (T tokens, sampled rows, to host: copies, bytes; to device: copies, bytes): {steps}")
    assert seen["prefill"] and seen["decode"]


def test_embed_and_rerank_equal_cpu_and_move_only_their_rows(embedding_small, reranker_small):
    """llm.embed and llm.rerank on device "cuda": the CPU's values, as NumPy arrays; per text the host gets
    one pooled row (D floats) or two logits, and nothing of the vocabulary."""
    pytest.importorskip("sentence_transformers")
    texts = ["The capital of China is Beijing.", "", "Gravity attracts two bodies towards each other. " * 30]
    query = "What is the capital of China?"
    for path, run, per_text in [(embedding_small, lambda llm: llm.embed(texts, dimensions=48), 64),
                                (embedding_small, lambda llm: llm.embed(texts, instruction="Find it"), 64),
                                (reranker_small, lambda llm: llm.rerank(query, texts), 2)]:
        cpu, cuda = npqwen.load(path), npqwen.load(path, device="cuda")
        want = run(cpu)
        strict_cupy.transfers.reset()
        got = run(cuda)
        print(f"{path.name}: max |diff| {np.abs(got - want).max():.1e}, to host {strict_cupy.transfers}")
        assert isinstance(got, np.ndarray) and got.shape == want.shape and np.array_equal(got, want)   # as above
        assert strict_cupy.transfers.to_host_bytes == len(texts) * per_text * 4


def stored_bytes(path: Path) -> int:
    """Bytes of tensor data in a single-file checkpoint (the file less its header)."""
    with open(path / "model.safetensors", "rb") as f:
        return (path / "model.safetensors").stat().st_size - 8 - int.from_bytes(f.read(8), "little")


def device_bytes(llm) -> int:
    """Bytes of the weights on the device (a tied lm_head is the embedding itself)."""
    return sum(a.nbytes for name, a in llm.weights.items()
               if not (name == "lm_head.weight" and llm.config.tie_word_embeddings))


@pytest.mark.parametrize("stored, dtype", [("BF16", "float32"), ("BF16", "float16"), ("F32", "float16")])
def test_load_uploads_each_weight_once(tmp_path, stored, dtype):
    """Each tensor goes up once, as stored (bf16 bits widen on the device); only a finite-check flag comes back."""
    path = write_npqwen_checkpoint(tmp_path, tiny_config(), dtype=stored)
    strict_cupy.transfers.reset()
    llm = npqwen.load(path, device="cuda", dtype=dtype)
    t = strict_cupy.transfers
    print(f"{stored} -> {dtype}: {t}; stored {stored_bytes(path)} bytes, on device {device_bytes(llm)} bytes")
    assert t.to_device_bytes == stored_bytes(path) + llm.model.inv_freq.nbytes
    assert t.to_host == len(llm.weights) - llm.config.tie_word_embeddings and t.to_host_bytes == t.to_host
    elements = stored_bytes(path) // (4 if stored == "F32" else 2)
    assert device_bytes(llm) == elements * np.dtype(dtype).itemsize


LOAD_RSS_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import strict_cupy
sys.modules["cupy"] = strict_cupy.cupy
import npqwen

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

before = status("VmRSS")
try:
    open("/proc/self/clear_refs", "w").write("5")   # VmHWM starts again from the current RSS
except OSError:
    pass                                             # else it holds the import's peak, below `before` + load
llm = npqwen.load({path!r}, device="cuda")
peak = status("VmHWM")
weights = sum(a.nbytes for n, a in llm.weights.items() if n != "lm_head.weight")
print(json.dumps(dict(before=before, peak=peak, weights=weights, uploaded=strict_cupy.transfers.to_device_bytes,
                      uploads=strict_cupy.transfers.to_device)))
"""


def test_load_holds_no_second_host_copy(tmp_path):
    """Load a ~340 MB float32 checkpoint to "cuda" in a fresh process and watch its peak RSS. The stand-in's
    device memory is host memory, so the peak is at least the weights once; a second full host copy (the
    checkpoint read whole, then uploaded) would add the checkpoint's size again. Allowed on top: 25%."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("peak RSS is read from /proc/self/status (Linux)")
    config = tiny_config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=128, vocab_size=32768)
    path = write_npqwen_checkpoint(tmp_path, config, dtype="F32")
    script = LOAD_RSS_SCRIPT.format(tests=str(Path(__file__).parent), path=str(path))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout.strip().splitlines()[-1])
    size = stored_bytes(path)
    grown = m["peak"] - m["before"]
    print(f"checkpoint {size / 2**20:.0f} MiB; uploaded {m['uploaded'] / 2**20:.0f} MiB in {m['uploads']} copies; "
          f"weights on the device {m['weights'] / 2**20:.0f} MiB; peak RSS grew {grown / 2**20:.0f} MiB "
          f"({(grown - m['weights']) / 2**20:.0f} MiB beyond the device's share)")
    assert m["weights"] == size and m["uploaded"] == size + 64 * 4   # + inv_freq (Dh/2 float32)
    assert grown - m["weights"] <= 0.25 * size


# --- the names used exist in the real cupy ----------------------------------------------------------------


def real_cupy():
    """The real cupy package (it imports without a GPU), or skip saying how to get it."""
    standin = sys.modules.pop("cupy")
    try:
        import cupy
        return cupy
    except ImportError as e:
        pytest.skip(f"the real cupy package is not installed ({e}); the test extra leaves its 300 MB CUDA wheel "
                    f"out: pip install -e '.[gpu-cuda12]' (it imports without a GPU) to check the names the stand-in "
                    f"offers and the code uses against it")
    finally:
        sys.modules["cupy"] = standin


def test_the_test_extra_brings_no_cuda_wheel():
    """The tests need of real CuPy only its namespace (the three tests that check the stand-in's names skip
    without it), so a CPU machine's test install leaves the gpu extras' wheels out (cupy-cuda12x was in it:
    a 137 MB download, 299 MB installed)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    name = lambda requirement: re.split(r"[<>=\[ ;]", requirement)[0].lower()   # noqa: E731
    gpu = {name(r) for extra, requirements in extras.items() if extra.startswith("gpu") for r in requirements}
    assert gpu and not gpu & {name(r) for r in extras["test"]}, gpu & {name(r) for r in extras["test"]}


def real_keywords(function) -> set[str]:
    """Keyword arguments a real cupy function takes: from its signature, else its docstring's first line
    (cupy's Cython ufuncs and methods carry one: 'tanh(x, /, out=None, \\*, casting=..., dtype=None)')."""
    try:
        params = inspect.signature(function).parameters.values()
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    except (TypeError, ValueError):
        pass
    first = (function.__doc__ or "").strip().splitlines()[0]
    params = [p.strip().lstrip("\\") for p in re.match(r"[\w.]+\((.*)\)", first).group(1).split(",")]
    if "/" in params:
        params = params[params.index("/") + 1:]
    return {p.split("=")[0].strip() for p in params if p not in ("self", "*") and not p.startswith("*")}


def check_against(real, names: dict) -> list[str]:
    """Problems with `names` ("cupy.a.b" or "ndarray.m" -> keywords) in the real cupy module."""
    problems = []
    for name, keywords in sorted(names.items()):
        owner, *path = name.split(".")
        obj = real if owner == "cupy" else real.ndarray
        for part in path:
            obj = getattr(obj, part, None)
        if obj is None:
            problems.append(f"{name} does not exist in cupy {real.__version__}")
        elif keywords and not set(keywords) <= real_keywords(obj):
            problems.append(f"{name}: keywords {sorted(set(keywords) - real_keywords(obj))} are not in cupy's")
    return problems


def test_every_offered_name_and_keyword_exists_in_real_cupy():
    real = real_cupy()
    problems = check_against(real, strict_cupy.offered_names())
    assert not problems, "\n".join(problems)


def test_every_name_and_keyword_used_exists_in_real_cupy(tiny_dir, tmp_path):
    """What the runs of this module asked of cupy (and a short run of each path here, so it holds when run
    alone): load in float32 and float16, forward with a recorder, the engine with sampling, a Qwen3-MoE."""
    from npqwen.trace import Trace

    for dtype in ("float32", "float16"):
        llm = npqwen.load(tiny_dir, device="cuda", dtype=dtype)
        llm.forward(list(range(30)), recorder=Trace())
        llm.generate([[1, 2, 3], list(range(40))], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1)
    moe_dir = write_npqwen_checkpoint(tmp_path / "moe", tiny_moe_config(), dtype="BF16")
    npqwen.load(moe_dir, device="cuda").generate([[1, 2], list(range(30))], max_new_tokens=3, temperature=0)
    real = real_cupy()
    used = dict(strict_cupy.used)
    print("used:", ", ".join(f"{n}({', '.join(sorted(k))})" if k else n for n, k in sorted(used.items())))
    problems = check_against(real, used)
    assert not problems, "\n".join(problems)


# --- the stand-in bites where CuPy does ------------------------------------------------------------------


def test_a_numpy_array_in_a_device_op_is_refused(cupy, planted, tiny_dir):
    x, host = cupy.ones((2, 3), dtype=np.float32), np.ones((2, 3), dtype=np.float32)
    for mixed in (lambda: x + host, lambda: host + x, lambda: x * np.float32(2) - host, lambda: np.add(host, x),
                  lambda: cupy.matmul(x, host.T), lambda: np.concatenate([x, host]), lambda: cupy.exp(host),
                  lambda: x.__setitem__(slice(None), host), lambda: cupy.add(x, [1.0, 2.0, 3.0])):
        with pytest.raises(TypeError, match="Unsupported type"):
            mixed()
    # planted in the model: RoPE frequencies left on the host
    llm = npqwen.load(tiny_dir, device="cuda")
    llm.model.inv_freq = llm.model.inv_freq.get()
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        llm.forward([1, 2, 3])


def test_implicit_conversion_to_numpy_is_refused(cupy, planted, monkeypatch, cpu_and_cuda):
    x = cupy.arange(6, dtype=np.float32).reshape(2, 3)
    total = x.sum()                               # a 0-d device array, not a NumPy scalar
    assert on_device(total) and total.shape == ()
    for implicit in (lambda: np.asarray(x), lambda: np.array(x), lambda: x.__array__(), lambda: np.asarray(total)):
        with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
            implicit()
    # planted in the engine: its logits taken to the host with np.asarray instead of to_numpy (x.get())
    monkeypatch.setattr("npqwen.engine.engine.to_numpy", np.asarray)
    engine = Engine(cpu_and_cuda[1], kv_cache_tokens=256, page_size=16)
    engine.add_request([1, 2, 3], max_new_tokens=2)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        engine.step()
    # the explicit ways across work and are counted
    strict_cupy.transfers.reset()
    assert float(total) == 15.0 and int(x[1, 2]) == 5 and x.max().item() == 5.0 and bool(x[0, 1])
    assert (x.get() == np.arange(6).reshape(2, 3)).all() and cupy.asnumpy(x).dtype == np.float32
    assert np.isfinite(np.tanh(x).get()).all()    # a NumPy ufunc on device arrays runs as CuPy's
    t = strict_cupy.transfers
    assert (t.to_host, t.to_host_bytes, t.to_device) == (7, 4 * 4 + 3 * 24, 0)   # 4 scalars, 3 arrays
    y = cupy.asarray(np.ones(4, dtype=np.float16))
    assert on_device(y) and (t.to_device, t.to_device_bytes) == (1, 8)
    assert (y @ y).dtype == np.float16 and (cupy.ones((3, 4), dtype=np.float16) @ y).dtype == np.float16


def test_a_name_cupy_lacks_is_refused(cupy, planted):
    x = cupy.zeros(3, dtype=np.float32)
    with pytest.raises(AttributeError, match="no attribute 'einsum_path'"):
        cupy.einsum_path("i,i", x, x)             # numpy has it, cupy does not
    with pytest.raises(AttributeError, match="no attribute 'resize'"):
        x.resize(4)                               # numpy.ndarray.resize; cupy.ndarray has none
    with pytest.raises(AttributeError, match="no attribute 'setflags'"):
        x.setflags(write=False)
    assert "cupy.einsum_path" in strict_cupy.used and "ndarray.resize" in strict_cupy.used
    if (real := real_cupy_or_none()) is not None:
        assert not hasattr(real, "einsum_path") and not hasattr(real.ndarray, "resize")


def test_a_keyword_cupy_lacks_is_refused(cupy, planted):
    x = cupy.ones(3, dtype=np.float32)
    for call, keyword in ((lambda: cupy.sum(x, where=x > 0), "where"), (lambda: x.sum(where=x > 0), "where"),
                          (lambda: cupy.einsum("i,i->", x, x, out=x[0]), "out"),
                          (lambda: cupy.zeros(3, like=x), "like"), (lambda: cupy.exp(x, where=x > 0), "where"),
                          (lambda: cupy.asarray([1.0], device="cuda"), "device")):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
            call()
    if (real := real_cupy_or_none()) is not None:
        assert "where" not in real_keywords(real.sum) and "out" not in real_keywords(real.einsum)


def test_cuda_unusable_or_absent_is_a_clear_error(cupy, monkeypatch, tiny_dir):
    """backend.array_module's two refusals, as CuPy reports them without a working driver or GPU."""
    def no_driver():
        raise cupy.cuda.runtime.CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    assert not cuda_available()
    with pytest.raises(NpqwenError, match="CuPy is installed but CUDA is not usable .*InsufficientDriver"):
        npqwen.load(tiny_dir, device="cuda")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 0)
    with pytest.raises(NpqwenError, match="no GPU is visible"):
        npqwen.load(tiny_dir, device="cuda")


def real_cupy_or_none():
    try:
        return real_cupy()
    except pytest.skip.Exception:
        return None
