"""tools/cuda_check.sh, the one command for a GPU machine, kept from rotting while no GPU is here: its dry
run (the same pipeline on the CPU, tests/strict_cupy.py as cupy, tiny shapes) passes every check and step,
writes its JSON and Markdown and leaves the checkout clean; a step that runs past its time is stopped with
its workers; a check that finds a difference says FAIL and what differed."""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import strict_cupy
from conftest import ROOT, build_hf_checkpoint, tiny_config

pytest.importorskip("transformers")


def load_tool(name: str):
    """tools/NAME.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of the whole pipeline: (exit status, stdout, the JSON report, the Markdown, git status
    before, after)."""
    tmp = tmp_path_factory.mktemp("cuda_check")
    before = git_status()
    started = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "tools" / "cuda_check.sh"), "--dry-run", "--out", str(tmp / "out"),
                           "--work", str(tmp / "work")], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable})
    print(f"dry run: {time.monotonic() - started:.0f} s, exit {done.returncode}\n{done.stderr[-3000:]}")
    report = json.loads((tmp / "out" / "cuda_check.json").read_text())
    return done, report, (tmp / "out" / "cuda_check.md").read_text(), (tmp / "out"), before, git_status()


def test_dry_run_passes_every_step_and_check(dry_run):
    done, report, _, _, _, _ = dry_run
    steps = {s["step"]: s["status"] for s in report["steps"]}
    print(json.dumps(steps, indent=1))
    assert steps == {name: "ok" for name, _ in load_tool("cuda_check").PLAN}
    assert report["dry_run"] and report["environment"]["npqwen_from_this_tree"]
    assert report["environment"]["first_kernel_ok"]
    checks = {c["check"]: c for c in report["checks"]}
    bad = {name: (c["status"], c["detail"]) for name, c in checks.items() if c["status"] not in ("pass", "not present")}
    assert not bad, bad
    from test_forward_golden import CASES
    for case in CASES:
        assert checks[f"forward float32: {case}"]["status"] == checks[f"forward float16: {case}"]["status"] == "pass"
    names = " / ".join(checks)
    for part in ("greedy = HF: tiny", "engine batched = alone: tiny", "seeded sampling = CPU",
                 "forward float32: Qwen3-0.6B shape", "forward float16: Qwen3-0.6B shape",
                 "greedy = HF: Qwen3-0.6B shape", "engine batched = alone: Qwen3-0.6B shape",
                 "MoE", "embeddings", "rerank scores", "structured output"):
        assert part in names, part
    features = {name: c for name, c in checks.items() if name.startswith(("MoE", "embeddings", "rerank", "structured"))}
    assert len(features) == 4 and all(c["status"] == "pass" for c in features.values()), features   # all in the tree
    assert "max |logit diff|" in checks[f"forward float32: {next(iter(CASES))}"]["detail"]
    assert done.returncode == 0, done.stderr[-2000:]


def test_dry_run_benchmarks_npqwen_on_the_stand_in_beside_hf(dry_run):
    _, report, _, _, _, _ = dry_run
    bench = report["bench"]
    assert set(bench) == {"bench-single", "bench-step", "bench-serving"}
    for name in ("bench-single", "bench-step"):
        engines = bench[name]["engines"]
        assert set(engines) == {"npqwen", "hf-float16", "hf-bfloat16"}
        assert not [e for e in engines.values() if "error" in e], engines
    single = bench["bench-single"]["engines"]
    assert all(single[e]["decode_8_tps"] > 0 and single[e]["prefill_64_tps"] > 0 for e in single)
    assert single["npqwen"]["batch1_8_tps"] > 0
    assert bench["bench-step"]["engines"]["npqwen"]["step_batch_s"] > 0
    runs = bench["bench-serving"]["serving"]["runs"]
    assert set(runs) == {"npqwen-engine", "npqwen-sequential", "hf-float16-static", "hf-bfloat16-static"}, runs
    assert runs["npqwen-engine"]["requests"] == 6 and runs["hf-float16-static"]["requests"] == 2
    # npqwen ran on device "cuda" (the stand-in), with the "GPU"'s limits measured the CuPy way
    machine = bench["bench-single"]["machine"]
    assert machine["device"] == "cuda" and machine["bandwidth_GBps"] > 0 and machine["matmul_GFLOPs"] > 0
    rows = report["summary"]["rows"]
    assert len(rows) == 8 and all(r["values"][0] is not None for r in rows), rows
    with_limits = ("decode tok/s, one sequence, 8", "prefill tok/s", "serving, 6")
    assert all(r["limit"] for r in rows if r["label"].startswith(with_limits)), rows


def test_dry_run_writes_its_tables_and_log_and_leaves_the_checkout_clean(dry_run):
    done, report, md, out, before, after = dry_run
    assert md.startswith("## npqwen CUDA check (DRY RUN")
    assert "| check | result | s | measured |" in md and "| | npqwen float16 | HF float16 | HF bfloat16 |" in md
    for c in report["checks"]:
        assert f"| {c['check']} | {c['status']} |" in md
    assert md.strip() in done.stdout                     # the summary printed is the Markdown written
    assert "===== golden" in (out / "cuda_check.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["cuda_check.json", "cuda_check.log", "cuda_check.md"]
    assert after == before, f"the dry run changed the checkout:\n{after}"


# --- the parts that a dry run does not reach -------------------------------------------------------------


SLEEPER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_step_past_its_time_is_stopped_with_its_workers(tmp_path):
    cuda_check = load_tool("cuda_check")
    args = SimpleNamespace(out=tmp_path, dry_run=False, budget=480)
    run = cuda_check.Run(args, set(), tmp_path)
    started = time.monotonic()
    status, stdout = run.run_step("sleepy", [sys.executable, "-c", SLEEPER], planned_end=run.elapsed() + 8)
    took = time.monotonic() - started
    worker = int(stdout.split()[0])
    print(status, f"{took:.1f} s")
    assert status == "stopped at the budget (8 s)" and took < 20
    time.sleep(0.5)
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text().lower()
    assert run.report["steps"][-1]["status"] == status
    assert run.run_step("late", ["true"], planned_end=run.elapsed() + 1)[0] == "not run"


def test_the_golden_results_say_where_a_stopped_step_was(tmp_path):
    cuda_check = load_tool("cuda_check")
    path = tmp_path / "golden.jsonl"
    lines = [{"planned": ["a", "b", "c"]}, {"check": "a", "status": "running"},
             {"check": "a", "status": "pass", "seconds": 1.0, "detail": "ok"}, {"check": "b", "status": "running"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stopped = cuda_check.golden_results(path, "stopped at the budget (100 s)")
    assert [c["status"] for c in stopped] == ["pass", "stopped", "not run"]
    assert [c["status"] for c in cuda_check.golden_results(path, "failed (exit -11)")] == ["pass", "error", "not run"]


def test_a_check_that_finds_a_difference_says_fail_and_what(tmp_path, monkeypatch):
    """A planted bug on the device (model.norm.weight off by 1%, after loading): the golden forward check
    fails with the tests' report line; an exception is an error; a missing feature is 'not present'."""
    golden = load_tool("cuda_check_golden")
    strict_cupy.install(monkeypatch)
    import npqwen

    load = npqwen.load

    def planted(*args, **kwargs):
        llm = load(*args, **kwargs)
        llm.weights["model.norm.weight"] *= 1.01
        return llm

    monkeypatch.setattr(npqwen, "load", planted)
    path = build_hf_checkpoint(tmp_path / "ckpt", tiny_config())
    results = tmp_path / "results.jsonl"
    ids = np.random.default_rng(1).integers(0, 512, size=20)
    r = golden.run_check("planted", lambda: golden.forward_float32(path, ids, "cpu"), results)
    print(r)
    assert r["status"] == "FAIL" and r["detail"].startswith("max |logit diff|")
    assert golden.run_check("broken", lambda: 1 / 0, results)["status"] == "error"
    assert golden.run_check("absent", golden.not_present("npqwen.nothing"), results)["status"] == "not present"
    statuses = [json.loads(line)["status"] for line in results.read_text().splitlines()]
    assert statuses == ["running", "FAIL", "running", "error", "running", "not present"]
