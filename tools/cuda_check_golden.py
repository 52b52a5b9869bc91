#!/usr/bin/env python3
"""The CUDA golden checks: npqwen on device "cuda" (real CuPy) against HF transformers on torch CUDA.

    python tools/cuda_check_golden.py --results FILE --work DIR --shape DIR [--reference-device cuda] [--dry-run]
    python tools/cuda_check_golden.py --build-shape DIR [--dry-run]    # the Qwen3-0.6B-shape checkpoint

tools/cuda_check.py runs this as its `checkpoint` and `golden` steps. Each check's result is one
JSON line in FILE, written the moment the check ends (a "running" line goes first), so a run
stopped at its time budget keeps every check it finished and shows which one it was in.

The checks are the golden tests' own, called directly: the checkpoints tests/conftest.py writes,
test_forward_golden's cases, comparison (logits and every layer's hidden states) and tolerances,
test_generate_golden's greedy and KV-cache checks, test_engine's batched-vs-alone run and
test_cuda_standin's float16 tolerance. Only the reference moves: HF's model runs on
--reference-device (torch CUDA on the GPU machine; the CPU in a dry run, where "cuda" is
tests/strict_cupy.py). The GPU machine need not have pytest, so the test modules are imported
under a placeholder `pytest` holding what they use at import time (decorators, marks,
importorskip); always, also where pytest is installed, so that CI's dry run takes the path the
GPU machine takes.

Checks of features that other parts of npqwen add (structured output, embeddings, MoE) run when
their module is there and report "not present" otherwise.
"""
import argparse
import contextlib
import gc
import importlib
import importlib.util
import io
import json
import sys
import time
import traceback
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


class Skipped(Exception):
    """A check that cannot run here (what pytest.skip would say)."""


def placeholder_pytest() -> types.ModuleType:
    """A `pytest` module with what the test modules use when they are imported: their decorators and
    marks change nothing, importorskip imports, skip raises Skipped (and fail AssertionError, for the
    helpers that call it). Nothing here runs a test."""
    pytest = types.ModuleType("pytest", placeholder_pytest.__doc__)

    def skip(reason="", **kwargs):                          # (allow_module_level=...)
        raise Skipped(reason)

    def importorskip(name, *args, **kwargs):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise Skipped(f"{name} is not installed ({e})") from e

    def fixture(function=None, **kwargs):                  # @pytest.fixture and @pytest.fixture(scope=...)
        return function if function is not None else (lambda f: f)

    def fail(reason=""):                                   # a helper's own failure: the check FAILs
        raise AssertionError(reason)

    skip.Exception = Skipped
    pytest.skip, pytest.importorskip, pytest.fixture, pytest.fail = skip, importorskip, fixture, fail
    pytest.mark = SimpleNamespace(parametrize=lambda *a, **k: (lambda f: f), skipif=lambda *a, **k: (lambda f: f))
    pytest.param = lambda *values, **kwargs: values[0] if len(values) == 1 else values
    return pytest


sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(ROOT))

import npqwen  # noqa: E402
from npqwen.backend import to_numpy  # noqa: E402

# The dry run's stand-in for the Qwen3-0.6B shape: its vocabulary and layout, 2 narrow layers.
DRY_RUN_SHAPE = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32)


def shape_config(dry_run: bool) -> dict:
    from conftest import QWEN3_0_6B
    return {**QWEN3_0_6B, **(DRY_RUN_SHAPE if dry_run else {})}


def build_shape(path: Path, dry_run: bool) -> Path:
    """The random bf16 checkpoint of the exact Qwen3-0.6B shape, as conftest's qwen3_0_6b_shape fixture writes it."""
    from conftest import QWEN3_TOKENIZER_DIR, add_qwen3_tokenizer, build_hf_checkpoint

    build_hf_checkpoint(path, shape_config(dry_run), std=0.02)
    if (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
        add_qwen3_tokenizer(path)
    return path


class Reference:
    """HF's model on `device`, called as the golden tests call a CPU one: inputs go to the device,
    logits and hidden states come back to the host."""

    def __init__(self, model, device: str):
        self.model, self.device = model.to(device), device

    def __call__(self, input_ids, **kwargs):
        import torch

        with torch.no_grad():
            out = self.model(input_ids.to(self.device), **kwargs)
        return SimpleNamespace(**{key: to_host(value) for key, value in out.items()})

    def generate(self, input_ids, attention_mask, **kwargs):
        return self.model.generate(input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                   **kwargs).cpu()

    def logits(self, ids) -> np.ndarray:
        import torch

        return self(torch.tensor(np.asarray(ids))[None]).logits[0].numpy()


def to_host(value):
    """A tensor, or a tuple of them (hidden states, router logits), on the host in float32; anything
    else (the KV cache) as it is."""
    import torch

    if isinstance(value, tuple):
        return tuple(to_host(v) for v in value)
    return value.float().cpu() if isinstance(value, torch.Tensor) else value


def hf_reference(path: Path, device: str, dtype: str = "float32") -> Reference:
    import torch
    from conftest import hf_model

    return Reference(hf_model(path).to(getattr(torch, dtype)), device)


# ---------------------------------------------------------------------------- the checks


def forward_float32(path: Path, ids, ref_device: str):
    """test_forward_golden.compare: logits within LOGIT_TOL, same argmax, every hidden state within 1e-5."""
    from test_forward_golden import compare

    llm = npqwen.load(path, device="cuda")
    diff = compare(llm, hf_reference(path, ref_device), ids, "cuda")
    return f"max |logit diff| {diff:.2e}, same argmax at all {len(ids)} positions, every hidden state within 1e-5"


def forward_float16(path: Path, ids, ref_device: str):
    """dtype float16 on the device: logits within test_cuda_standin's FLOAT16_LOGIT_TOL of HF's float32 ones,
    or, where that is larger, within twice the distance HF's own float16 logits are from them."""
    from test_cuda_standin import FLOAT16_LOGIT_TOL

    llm = npqwen.load(path, device="cuda", dtype="float16")
    logits = llm.forward(ids)
    assert logits.dtype == np.float16, logits.dtype
    want = hf_reference(path, ref_device).logits(ids)
    ours = np.abs(to_numpy(logits).astype(np.float32) - want).max()
    hf16 = np.abs(hf_reference(path, ref_device, "float16").logits(ids) - want).max()
    tolerance = max(FLOAT16_LOGIT_TOL, 2 * hf16)
    report = (f"float16 max |logit diff| from HF float32: npqwen {ours:.3e}, HF float16 {hf16:.3e} "
              f"(allowed {tolerance:.1e}; max |logit| {np.abs(want).max():.2e})")
    print(report)
    assert ours <= tolerance, report
    return report


def greedy(path: Path, prompts: list, ref_device: str, recompute: bool):
    """test_generate_golden.check_greedy for each prompt (32 new tokens, equal token for token), and, with
    `recompute` (the tiny model's vocabulary), its KV-cache check: decode steps vs one full forward."""
    from test_generate_golden import check_cache_equals_recompute, check_greedy

    llm, ref = npqwen.load(path, device="cuda"), hf_reference(path, ref_device)
    for prompt in prompts:
        check_greedy(llm, ref, prompt)
    if recompute:
        check_cache_equals_recompute(llm, np.random.default_rng(3).integers(0, 512, size=40).tolist(), n=16)
    return (f"{len(prompts)} prompts: 32 greedy tokens each (fewer at eos), equal to HF's" +
            (", KV-cache decode = full recompute within 1e-4" if recompute else ""))


def batched_equals_alone(path: Path, lengths: list, vocab: int, new_tokens, page_size: int):
    """test_engine's batched-vs-alone run: every prompt at once through the Engine (chunked prefill,
    batched decode), each equal to the single-sequence path alone, logits within 1e-4 (float32)."""
    from test_engine import alone, compare, prompts, run

    llm = npqwen.load(path, device="cuda")
    ps = prompts(lengths, seed=2, vocab=vocab)
    news = [new_tokens(i) for i in range(len(ps))]
    engine = npqwen.Engine(llm, kv_cache_tokens=4096, page_size=page_size, max_batched_tokens=256)
    results = run(engine, [(p, dict(max_new_tokens=n, temperature=0)) for p, n in zip(ps, news)], spy=True)
    worst = max(compare(f"prompt {len(p)}", r[0], r[1], *alone(llm, p, n)) for p, n, r in zip(ps, news, results))
    assert worst <= 1e-4, f"max |logit diff| batched vs alone {worst:.2e} > 1e-4"
    return f"{len(ps)} requests: tokens equal, max |logit diff| {worst:.2e}"


def sampling_equals_cpu(path: Path):
    """test_cuda_standin's seeded sampling: the same tokens on the device as on the CPU."""
    cpu, cuda = npqwen.load(path, device="cpu"), npqwen.load(path, device="cuda")
    prompt = np.random.default_rng(5).integers(0, 512, size=23).tolist()
    for sampling in (dict(temperature=0.8, top_k=40, top_p=0.9, seed=7),
                     dict(temperature=1.2, min_p=0.05, repetition_penalty=1.3, seed=11)):
        want = cpu.generate(prompt, max_new_tokens=24, **sampling).token_ids
        got = cuda.generate(prompt, max_new_tokens=24, **sampling).token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        print(f"{sampling}: first token that differs from the CPU's: {first}")
        assert got == want and len(got) == 24, f"cpu {want}\ncuda {got}"
    return "2 seeded samplers: 24 tokens each, equal to the CPU's"


# ---------------------------------------------------------------------------- features added elsewhere

def moe_equals_hf(work: Path, ref_device: str):
    """test_moe's cases: logits, every layer's output, the router's logits and choices equal HF's
    (test_moe.check_against_hf), on the device."""
    from test_moe import CASES, check_against_hf, hf_forward, moe_checkpoint

    worst = 0.0
    for case in CASES:
        path = moe_checkpoint(work / f"moe-{case}", case)
        llm = npqwen.load(path, device="cuda")
        ids = np.random.default_rng(1).integers(0, llm.config.vocab_size, size=33)
        worst = max(worst, check_against_hf(llm, ids, hf_forward(hf_reference(path, ref_device), ids)))
    return f"{len(CASES)} checkpoints: max |logit diff| {worst:.2e}, the same experts chosen"


def embeddings_equal_hf(path: Path, ref_device: str):
    """llm.embed (last-token pooling, not normalised: a checkpoint without sentence-transformers files)
    equals HF's final-norm hidden state at each input's last position."""
    import torch

    llm, ref = npqwen.load(path, device="cuda"), hf_reference(path, ref_device)
    inputs = [np.random.default_rng(n).integers(0, 512, size=n).tolist() for n in (3, 40, 200)]
    got = to_numpy(llm.embed(inputs))
    want = np.stack([ref(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
                     for ids in inputs])
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    print(f"{len(inputs)} embeddings of width {want.shape[-1]}: max |diff| from HF {err:.2e} (max |value| {scale:.2e})")
    assert got.shape == want.shape and err <= 1e-5 * max(1.0, scale), f"max |diff| {err:.2e} from HF"
    return f"{len(inputs)} inputs: max |diff| from HF's last-token hidden state {err:.2e}"


def rerank_scores_equal_hf(path: Path, ref_device: str):
    """The reranker's scores (engine.new_scoring_request: two tokens' logits at the last position, two rows
    of lm_head) equal HF's logits of those tokens, for prompts that share a prefix (the prefix cache)."""
    import torch

    llm, ref = npqwen.load(path, device="cuda"), hf_reference(path, ref_device)
    shared = np.random.default_rng(3).integers(0, 512, size=40).tolist()
    prompts = [shared + np.random.default_rng(n).integers(0, 512, size=n).tolist() for n in (1, 9, 70)]
    token_ids = [7, 300]
    got = np.stack([o.scores for o in llm.run_prefill_only(
        [llm.engine.new_scoring_request(p, token_ids) for p in prompts])])
    want = np.stack([ref(torch.tensor([p])).logits[0, -1, token_ids].numpy() for p in prompts])
    err = np.abs(got - want).max()
    print(f"{len(prompts)} prompts, 2 tokens: max |logit diff| from HF {err:.2e}")
    assert got.shape == want.shape and err <= 1e-4, f"max |logit diff| {err:.2e} from HF"
    return f"{len(prompts)} prompts sharing a prefix: max |logit diff| from HF {err:.2e}"


def structured_equals_cpu():
    """A JSON-schema and a regex constraint on the built-in tiny model (it has a tokenizer): greedy answers
    on the device equal the CPU's, token for token, and match the constraint."""
    import json
    import re

    if importlib.util.find_spec("llguidance") is None:
        raise Skipped("llguidance is not installed (pip install 'npqwen[structured]')")
    cpu, cuda = npqwen.load("tiny", device="cpu"), npqwen.load("tiny", device="cuda")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for constraint in (dict(json_schema=schema), dict(regex="[0-9]{3}-[a-z]{2}")):
        want = cpu.generate("Answer:", max_new_tokens=32, temperature=0, **constraint)
        got = cuda.generate("Answer:", max_new_tokens=32, temperature=0, **constraint)
        print(f"{constraint}: cpu {want.text!r}, cuda {got.text!r}")
        assert got.token_ids == want.token_ids, f"{constraint}: cpu {want.text!r}, cuda {got.text!r}"
        if "regex" in constraint:
            assert re.fullmatch(constraint["regex"], got.text), got.text
        else:
            assert isinstance(json.loads(got.text)["n"], int), got.text
    return "a JSON schema and a regex: answers valid, equal to the CPU's"


# ---------------------------------------------------------------------------- the list, and running it

def checks(args) -> list[tuple[str, callable]]:
    """(name, function) of every check, in the order they run: the tiny cases first, then the exact shape."""
    from conftest import build_hf_checkpoint, tiny_config, write_npqwen_checkpoint
    from test_engine import LENGTHS
    from test_forward_golden import CASES

    work, ref, shape = args.work, args.reference_device, args.shape
    out = []

    def tiny_case(case):   # written once, for its float32 and float16 checks
        overrides, save_dtype, shard, _ = CASES[case]
        if not (work / case / "config.json").is_file():
            build_hf_checkpoint(work / case, tiny_config(**overrides), save_dtype=save_dtype, shard=shard)
        return work / case

    def case_ids(case):
        return np.random.default_rng(1).integers(0, tiny_config(**CASES[case][0])["vocab_size"], size=CASES[case][3])

    for case in CASES:
        out.append((f"forward float32: {case}", lambda c=case: forward_float32(tiny_case(c), case_ids(c), ref)))
    for case in CASES:
        out.append((f"forward float16: {case}", lambda c=case: forward_float16(tiny_case(c), case_ids(c), ref)))

    def gen_tiny():
        path = work / "gen-tiny"
        if not (path / "config.json").is_file():
            build_hf_checkpoint(path, tiny_config(max_position_embeddings=1024), std=0.1)
        return path

    lengths = (1, 5, 37, 600)   # test_generate_golden's; 600 crosses a prefill chunk boundary (512)
    out.append(("greedy = HF: tiny, prompts of 1, 5, 37, 600 tokens",
                lambda: greedy(gen_tiny(), [np.random.default_rng(n).integers(0, 512, size=n).tolist()
                                            for n in lengths], ref, recompute=True)))
    out.append((f"engine batched = alone: tiny, {len(LENGTHS)} prompts of 1-700 tokens",
                lambda: batched_equals_alone(gen_tiny(), LENGTHS, 512, lambda i: 3 + (7 * i) % 13, 16)))
    out.append(("seeded sampling = CPU: tiny", lambda: sampling_equals_cpu(
        write_npqwen_checkpoint(work / "np-tiny", tiny_config(max_position_embeddings=1024), dtype="BF16"))))

    name = "Qwen3-0.6B shape" + (" (dry run: 2 layers, D=128)" if args.dry_run else "")
    ids = np.random.default_rng(2).integers(0, 151_643, size=24)
    rng = np.random.default_rng(7)
    shape_prompts = [rng.integers(0, 151_643, size=n).tolist() for n in (9, 130)]
    out += [(f"forward float32: {name}", lambda: forward_float32(shape, ids, ref)),
            (f"forward float16: {name}", lambda: forward_float16(shape, ids, ref)),
            (f"greedy = HF: {name}, prompts of 9, 130 tokens",
             lambda: greedy(shape, shape_prompts, ref, recompute=False)),
            (f"engine batched = alone: {name}, prompts of 3, 40, 130, 300 tokens",
             lambda: batched_equals_alone(shape, [3, 40, 130, 300], 151_643, lambda i: 6, 64))]

    features = [("MoE = HF: test_moe's tiny checkpoints", "npqwen.moe", lambda: moe_equals_hf(work, ref)),
                ("embeddings = HF: tiny", "npqwen.embed", lambda: embeddings_equal_hf(gen_tiny(), ref)),
                ("rerank scores = HF: tiny", "npqwen.rerank", lambda: rerank_scores_equal_hf(gen_tiny(), ref)),
                ("structured output = CPU: the built-in tiny model", "npqwen.structured", structured_equals_cpu)]
    for label, module, check in features:
        out.append((label, check if importlib.util.find_spec(module) else not_present(module)))
    return out


def not_present(module: str):
    def check():
        raise NotPresent(f"{module} is not in this working tree")
    return check


class NotPresent(Exception):
    """A feature check whose npqwen module does not exist (yet)."""


def run_check(name: str, function, results) -> dict:
    """Run one check with its printed lines captured: pass, FAIL (an assertion: the tests' report line),
    error (anything else, with its traceback on stderr), skipped, or not present."""
    write(results, {"check": name, "status": "running"})
    started, printed = time.perf_counter(), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            detail = function() or ""
        status = "pass"
    except AssertionError as e:
        status, detail = "FAIL", str(e)
    except Skipped as e:
        status, detail = "skipped", str(e)
    except NotPresent as e:
        status, detail = "not present", str(e)
    except Exception as e:   # noqa: BLE001  a check that breaks is reported, and the next one runs
        status, detail = "error", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    lines = [line for line in printed.getvalue().splitlines() if line.strip()]
    result = {"check": name, "status": status, "seconds": round(time.perf_counter() - started, 2),
              "detail": detail.strip().splitlines()[0] if detail.strip() else "", "printed": lines}
    write(results, result)
    print(f"[golden] {status:>11}  {result['seconds']:6.1f} s  {name}: {result['detail']}",
          file=sys.stderr, flush=True)
    free_device_memory()
    return result


def free_device_memory():
    """Drop the last check's models and hand CuPy's cached blocks back, so the next engine's default KV
    pool (half the free memory) and torch see the whole GPU again."""
    gc.collect()
    cupy = sys.modules.get("cupy")
    if cupy is not None and hasattr(cupy, "get_default_memory_pool"):   # real CuPy; the stand-in has no pool
        cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def write(results: Path, line: dict):
    with open(results, "a") as f:
        f.write(json.dumps(line) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, help="append one JSON line per check here")
    p.add_argument("--work", type=Path, help="a folder for the tiny checkpoints")
    p.add_argument("--shape", type=Path, help="the Qwen3-0.6B-shape checkpoint (from --build-shape)")
    p.add_argument("--build-shape", type=Path, metavar="DIR", help="write the Qwen3-0.6B-shape checkpoint and stop")
    p.add_argument("--reference-device", default="cuda", help="torch device of the HF reference (default cuda)")
    p.add_argument("--dry-run", action="store_true", help="the small stand-in for the Qwen3-0.6B shape")
    args = p.parse_args(argv)
    sys.modules["pytest"] = placeholder_pytest()   # before the first test module is imported
    if args.build_shape:
        build_shape(args.build_shape, args.dry_run)
        print(f"[golden] {'dry-run ' if args.dry_run else ''}Qwen3-0.6B-shape checkpoint in {args.build_shape}",
              file=sys.stderr)
        return 0
    if not (args.results and args.work and args.shape):
        p.error("--results, --work and --shape are needed (or --build-shape DIR)")
    import torch

    if args.reference_device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"torch {torch.__version__} sees no CUDA device for the HF reference")
    args.work.mkdir(parents=True, exist_ok=True)
    todo = checks(args)
    write(args.results, {"planned": [name for name, _ in todo]})
    results = [run_check(name, function, args.results) for name, function in todo]
    return 0 if all(r["status"] in ("pass", "skipped", "not present") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
