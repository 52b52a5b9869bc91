#!/usr/bin/env python3
"""The one command for a GPU machine: npqwen's CUDA path checked against HF transformers, and measured beside it.

    tools/cuda_check.sh                          # on the GPU machine: results in $OUT, or --out DIR
    tools/cuda_check.sh --dry-run --out DIR      # the same pipeline on the CPU: strict CuPy stand-in, tiny shapes

Seven steps, each in a process of its own, timed, and stopped if it runs past its planned end: its
share of --budget (default 480 s), counted from the start, so the time an early step leaves over is
the next one's. A step that is stopped or breaks ends only itself; what finished is kept.

  install        npqwen from this working tree without dependencies (pip install --no-deps -e .; a dry
                 run only asks pip, with --dry-run, and leaves the environment as it is). Every step also
                 has the tree first on PYTHONPATH, so npqwen imports from here even where pip cannot install.
  environment    versions (Python, numpy, CuPy, CUDA, torch, transformers, pytest), the GPU, a first CuPy kernel
  checkpoint     a random-weight bf16 checkpoint of the exact Qwen3-0.6B shape, written by transformers
  golden         tools/cuda_check_golden.py: npqwen on real CuPy against HF transformers on torch CUDA
  bench-single   python -m tools.bench --device cuda: decode of one sequence, prefill of 128 and 1024 tokens
  bench-step     the 1024-token prefill step, one decode step of 32 requests x 512 positions
  bench-serving  the 64-request serving workload, and the prefix cache

The benchmark runs npqwen in float16 beside HF transformers float16 and bfloat16 on the same GPU in
the same run, and measures the GPU's own limits: memory bandwidth (a device-to-device copy) for
decode, the float16 matrix rate (a large product) for prefill.

Into the folder: cuda_check.json (everything), cuda_check.md (the tables for
docs/cuda.md) and cuda_check.log (every step's output), rewritten after each step; the Markdown is
printed at the end. Exit status 0 when every step ran and every check passed.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
GOLDEN = ROOT / "tools" / "cuda_check_golden.py"
DEFAULT_BUDGET_S = 480
REPORT_RESERVE_S = 10        # kept free at the end for the last report
ENGINES = "npqwen,hf-float16,hf-bfloat16"
# (step, planned seconds at the default budget; scaled with --budget)
PLAN = [("install", 15), ("environment", 25), ("checkpoint", 40), ("golden", 130),
        ("bench-single", 80), ("bench-step", 50), ("bench-serving", 130)]
# The benchmark's sizes: on the GPU its defaults (the CPU tables' sizes); in a dry run, tiny ones.
SIZES = {
    "gpu": dict(prefill=(128, 1024), decode=(16, 2048), new_tokens=128, repeats=2, step_prefill=1024, step_batch=32,
                step_context=512, requests=64, sample=16, prompt_lens="32-512", output_lens="16-256", hf_batch=16,
                prefix_tokens=1024, prefix_requests=16),
    "dry-run": dict(prefill=(16, 64), decode=(8, 32), new_tokens=6, repeats=1, step_prefill=64, step_batch=4,
                    step_context=32, requests=6, sample=2, prompt_lens="8-32", output_lens="2-6", hf_batch=2,
                    prefix_tokens=64, prefix_requests=2),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=os.environ.get("OUT"),
                   help="folder for cuda_check.json / .md / .log (default: $OUT)")
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU: tests/strict_cupy.py as cupy, HF on the CPU, tiny shapes (about a minute)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds for the whole run (default {DEFAULT_BUDGET_S}); each step gets its share")
    p.add_argument("--steps", default=",".join(s for s, _ in PLAN),
                   help="comma-separated steps to run (default all); checkpoint runs when golden or bench needs it")
    p.add_argument("--work", type=Path, help="folder for checkpoints and step outputs (default: a temporary one, "
                                             "removed at the end)")
    p.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)   # the environment step's process
    args = p.parse_args(argv)
    if args.environment:
        print(json.dumps(environment(args.dry_run)))
        return 0
    if args.out is None:
        p.error("say where the results go: --out DIR, or set $OUT")
    wanted = {s for s in args.steps.split(",") if s}
    unknown = wanted - {s for s, _ in PLAN}
    if unknown:
        p.error(f"unknown step(s) {', '.join(sorted(unknown))}; the steps are {', '.join(s for s, _ in PLAN)}")
    if wanted & {"golden", "bench-single", "bench-step", "bench-serving"}:
        wanted.add("checkpoint")
    if args.budget < 60:
        p.error("--budget must be at least 60 seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="npqwen-cuda-check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return Run(args, wanted, work).all()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


class Run:
    """One run of the pipeline: its steps' results, gathered into the report as they end."""

    def __init__(self, args, wanted: set, work: Path):
        self.args, self.wanted, self.work, self.out = args, wanted, work, args.out
        self.dry_run = args.dry_run
        self.sizes = SIZES["dry-run" if self.dry_run else "gpu"]
        self.start = time.monotonic()
        self.log = self.out / "cuda_check.log"
        self.log.write_text("")
        self.shape = work / "qwen3-0.6b-shape"
        self.env = self.environment_variables()
        self.report = {"dry_run": self.dry_run, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "budget_s": args.budget, "elapsed_s": 0.0, "environment": {}, "steps": [], "checks": [],
                       "bench": {}}

    def environment_variables(self) -> dict:
        """Every step's environment: this tree first on PYTHONPATH (in a dry run after the stand-in), offline."""
        path = [str(ROOT)]
        if self.dry_run:
            path.insert(0, str(standin_cupy(self.work)))
        return {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(":"),
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def all(self) -> int:
        planned = 0
        scale = (self.args.budget - REPORT_RESERVE_S) / sum(s for _, s in PLAN)
        for name, seconds in PLAN:
            planned += seconds * scale
            if name not in self.wanted:
                self.note(name, "not asked for", 0.0, planned)
                continue
            getattr(self, name.replace("-", "_"))(planned)
            self.write()
        self.write()
        print(markdown(self.report))
        failed = [s for s in self.report["steps"] if s["status"] not in ("ok", "not asked for")]
        bad = [c for c in self.report["checks"] if c["status"] not in ("pass", "not present", "skipped")]
        return 1 if failed or bad else 0

    # ------------------------------------------------------------------------ the steps

    def install(self, planned_end):
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-e",
               str(ROOT)] + (["--dry-run"] if self.dry_run else [])
        self.run_step("install", cmd, planned_end)

    def environment(self, planned_end):
        cmd = [sys.executable, __file__, "--environment"] + (["--dry-run"] if self.dry_run else [])
        status, stdout = self.run_step("environment", cmd, planned_end)
        if status == "ok":
            self.report["environment"] = json.loads(stdout.strip().splitlines()[-1])

    def checkpoint(self, planned_end):
        cmd = [sys.executable, str(GOLDEN), "--build-shape", str(self.shape)] + (["--dry-run"] if self.dry_run else [])
        self.run_step("checkpoint", cmd, planned_end)

    def golden(self, planned_end):
        results = self.work / "golden.jsonl"
        cmd = [sys.executable, str(GOLDEN), "--results", str(results), "--work", str(self.work / "golden"),
               "--shape", str(self.shape), "--reference-device", "cpu" if self.dry_run else "cuda"] + \
            (["--dry-run"] if self.dry_run else [])
        status, _ = self.run_step("golden", cmd, planned_end)
        self.report["checks"] = golden_results(results, status)

    def bench_single(self, planned_end):
        s = self.sizes
        self.bench("bench-single", ["--suites", "prefill,decode,batch1", "--prefill", ",".join(map(str, s["prefill"])),
                                    "--decode-prompts", ",".join(map(str, s["decode"])),
                                    "--new-tokens", str(s["new_tokens"])], planned_end)

    def bench_step(self, planned_end):
        s = self.sizes
        self.bench("bench-step", ["--suites", "step", "--step-prefill", str(s["step_prefill"]),
                                  "--step-batch", str(s["step_batch"]), "--step-context", str(s["step_context"])],
                   planned_end)

    def bench_serving(self, planned_end):
        s = self.sizes
        self.bench("bench-serving", ["--suites", "serving,prefix", "--serving-requests", str(s["requests"]),
                                     "--serving-sample", str(s["sample"]), "--serving-prompt-lens", s["prompt_lens"],
                                     "--serving-output-lens", s["output_lens"], "--serving-batch", str(s["hf_batch"]),
                                     "--prefix-tokens", str(s["prefix_tokens"]),
                                     "--prefix-requests", str(s["prefix_requests"])], planned_end)

    def bench(self, name, suite_args, planned_end):
        """One benchmark run (its engines each in a worker process of their own), its JSON report kept."""
        if not (self.shape / "config.json").is_file():
            self.note(name, "not run: no checkpoint (see the checkpoint step)", 0.0, planned_end)
            return
        cmd = [sys.executable, "-m", "tools.bench", "--model", str(self.shape), "--device", "cuda", "--dtype",
               "float16", "--engines", ENGINES, "--repeats", str(self.sizes["repeats"]), "--json", *suite_args]
        if self.dry_run:
            cmd += ["--hf-device", "cpu"]    # the HF peers need torch CUDA, which the dry run does not have
        status, stdout = self.run_step(name, cmd, planned_end)
        if status == "ok":
            self.report["bench"][name] = json.loads(stdout)

    # ------------------------------------------------------------------------ running a step

    def run_step(self, name, cmd, planned_end) -> tuple[str, str]:
        """Run `cmd` in its own process group until the step's planned end; stderr goes to the log.
        (status, stdout): ok, failed (exit N), or stopped at the budget (the whole group is killed)."""
        limit = planned_end - self.elapsed()
        if limit < 5:
            self.note(name, "not run: the budget was spent", 0.0, planned_end)
            return "not run", ""
        with open(self.log, "a") as log:
            log.write(f"\n===== {name} (up to {limit:.0f} s): {' '.join(cmd)}\n")
            log.flush()
            started = time.monotonic()
            stdout_path = self.work / f"{name}.stdout"
            with open(stdout_path, "w") as stdout:
                proc = subprocess.Popen(cmd, stdout=stdout, stderr=log, cwd=ROOT, env=self.env,
                                        start_new_session=True)
                try:
                    rc = proc.wait(timeout=limit)
                    status = "ok" if rc == 0 else f"failed (exit {rc})"
                except subprocess.TimeoutExpired:
                    stop_group(proc)
                    status = f"stopped at the budget ({limit:.0f} s)"
            seconds = time.monotonic() - started
            log.write(f"===== {name}: {status} in {seconds:.1f} s\n")
        print(f"[cuda_check] {name}: {status} in {seconds:.1f} s", file=sys.stderr, flush=True)
        self.note(name, status, seconds, planned_end, last_line(self.log) if status.startswith("failed") else "")
        return status, stdout_path.read_text()

    def note(self, name, status, seconds, planned_end, detail=""):
        self.report["steps"].append({"step": name, "status": status, "seconds": round(seconds, 1),
                                     "planned_end_s": round(planned_end), "detail": detail})

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def write(self):
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        self.report["summary"] = summary(self.report, self.sizes)
        (self.out / "cuda_check.json").write_text(json.dumps(self.report, indent=2))
        (self.out / "cuda_check.md").write_text(markdown(self.report) + "\n")


def stop_group(proc):
    """End a step that ran past its time: SIGTERM to its whole process group (the benchmark's workers
    too), then SIGKILL to what is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(log: Path) -> str:
    """The last line of the log that says something (a failed step's error), skipping the step banner."""
    lines = [line for line in log.read_text().splitlines() if line.strip() and not line.startswith("=====")]
    return lines[-1][:300] if lines else ""


def standin_cupy(work: Path) -> Path:
    """A folder whose cupy.py makes `import cupy` give tests/strict_cupy.py's stand-in: first on PYTHONPATH in a
    dry run, so every process of the run (the benchmark's workers too) takes the device code path on the CPU."""
    folder = work / "strict-cupy"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cupy.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport strict_cupy\n"
                                    f"sys.modules[__name__] = strict_cupy.cupy\n")
    return folder


def golden_results(path: Path, step_status: str) -> list[dict]:
    """Each planned check's last line in the golden step's results: its result, or, for a check still
    "running" when the step ended, what ended it; a check never reached is "not run"."""
    planned, last = [], {}
    if path.is_file():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "planned" in entry:
                planned = entry["planned"]
            else:
                last[entry["check"]] = entry
    out = []
    for name in planned:
        entry = last.get(name, {"check": name, "status": "not run", "seconds": 0.0, "detail": ""})
        if entry["status"] == "running":
            entry = {**entry, "status": "stopped" if step_status.startswith("stopped") else "error", "seconds": None,
                     "detail": f"the golden step ended ({step_status}) during this check"}
        out.append(entry)
    return out


# ---------------------------------------------------------------------------- the environment step

def environment(dry_run: bool) -> dict:
    """What this machine has: versions, where npqwen imports from, the GPU as CuPy and torch see it,
    and one small CuPy computation (which compiles a kernel: NVRTC must work)."""
    import importlib.metadata
    import platform

    import numpy as np

    import npqwen

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "numpy": np.__version__, "npqwen": npqwen.__file__,
           "npqwen_from_this_tree": Path(npqwen.__file__).resolve().is_relative_to(ROOT)}
    env.update({name: version(name) for name in ("torch", "transformers", "safetensors", "tokenizers", "jinja2",
                                                 "pytest", "cupy-cuda12x", "cupy-cuda13x")})
    try:
        import torch
        env.update(torch_cuda=torch.version.cuda, torch_sees_gpu=torch.cuda.is_available())
        if torch.cuda.is_available():
            env["torch_gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:   # noqa: BLE001  what is wrong goes into the report; the later steps will say more
        env["torch_error"] = f"{type(e).__name__}: {e}"
    try:
        import cupy
        if dry_run:
            env["gpu"] = "none: dry run on the CPU, cupy is tests/strict_cupy.py"
        else:
            runtime = cupy.cuda.runtime
            props = runtime.getDeviceProperties(0)
            name = props["name"]
            env.update(cupy=cupy.__version__, cuda_runtime=runtime.runtimeGetVersion(),
                       cuda_driver=runtime.driverGetVersion(), gpus=runtime.getDeviceCount(),
                       gpu=name.decode() if isinstance(name, bytes) else name,
                       gpu_memory_GiB=round(props["totalGlobalMem"] / 2**30, 1))
        x = cupy.arange(4, dtype=np.float32)
        env["first_kernel_ok"] = float((x * 2).sum()) == 12.0
    except Exception as e:   # noqa: BLE001  (no GPU, no driver, no NVRTC to compile the first kernel)
        env["cupy_error"] = f"{type(e).__name__}: {e}"
    return env


# ---------------------------------------------------------------------------- the summary

def summary(report, sizes) -> dict:
    """The figures of docs/cuda.md's table, from the benchmark's reports: each engine's decode and
    prefill rates, the two steps, serving output tokens/s, and the GPU's limits beside them."""
    bench, out = report["bench"], {"rows": [], "gpu": {}}
    for name in ("bench-single", "bench-step", "bench-serving"):
        for k, v in bench.get(name, {}).get("machine", {}).items():
            if k in ("bandwidth_GBps", "matmul_GFLOPs"):   # measured in each run; the best counts
                out["gpu"][k] = max(v, out["gpu"].get(k, v))
    engines = ENGINES.split(",")
    short, long = sizes["decode"]
    T = sizes["prefill"][-1]

    def row(label, values, limit=None, unit=""):
        out["rows"].append({"label": label, "values": values, "limit": limit, "unit": unit})

    single = bench.get("bench-single")
    if single:
        e, f = single["engines"], single["figures"]
        row(f"decode tok/s, one sequence, {short}-token prompt", [e.get(n, {}).get(f"decode_{short}_tps")
                                                                   for n in engines], f.get("decode_bound_tps"))
        row(f"decode tok/s, one sequence, {long}-token prompt", [e.get(n, {}).get(f"decode_{long}_tps")
                                                                  for n in engines])
        row(f"decode tok/s, a batch of one through the engine, {short}-token prompt",
            [e.get("npqwen", {}).get(f"batch1_{short}_tps"), None, None])
        pct = f.get(f"prefill_{T}_pct_of_matmul")
        ours = e.get("npqwen", {}).get(f"prefill_{T}_tps")
        row(f"prefill tok/s, {T}-token prompt", [e.get(n, {}).get(f"prefill_{T}_tps") for n in engines],
            ours / (pct / 100) if pct and ours else None)
    step = bench.get("bench-step")
    if step:
        e = step["engines"]
        row(f"prefill step, {sizes['step_prefill']} tokens (ms)",
            [ms(e.get(n, {}).get("step_prefill_s")) for n in engines], unit="ms")
        row(f"decode step, {sizes['step_batch']} requests x {sizes['step_context']} positions (ms)",
            [ms(e.get(n, {}).get("step_batch_s")) for n in engines], unit="ms")
    serving = bench.get("bench-serving")
    if serving:
        runs, f = serving["serving"]["runs"], serving["figures"]
        engine = runs.get("npqwen-engine", {})
        bound = engine["output_tokens"] / f["serving_linear_bound_s"] if "serving_linear_bound_s" in f else None
        row(f"serving, {sizes['requests']} requests: output tok/s (npqwen: its engine, all; HF: static batches of "
            f"{sizes['hf_batch']}, the first {sizes['sample']})",
            [engine.get("output_tps")] + [runs.get(f"{n}-static", {}).get("output_tps") for n in engines[1:]], bound)
        row(f"serving: npqwen one request at a time (the first {sizes['sample']}): output tok/s",
            [runs.get("npqwen-sequential", {}).get("output_tps"), None, None])
    return out


def ms(seconds):
    return None if seconds is None else 1e3 * seconds


# ---------------------------------------------------------------------------- the Markdown

def markdown(report) -> str:
    env, s = report["environment"], report["summary"]
    title = "npqwen CUDA check" + (" (DRY RUN: on the CPU with the strict CuPy stand-in, tiny shapes; not a GPU "
                                   "measurement)" if report["dry_run"] else "")
    gpu = s["gpu"]
    measured = ", ".join(x for x in (
        f"device-to-device copy {gpu['bandwidth_GBps']:.0f} GB/s" if "bandwidth_GBps" in gpu else "",
        f"float16 matrix product {gpu['matmul_GFLOPs'] / 1e3:.1f} TFLOP/s" if "matmul_GFLOPs" in gpu else "") if x)
    versions = ", ".join(f"{k} {env[k]}" for k in ("python", "numpy", "cupy", "cuda_runtime", "cuda_driver", "torch",
                                                  "torch_cuda", "transformers") if env.get(k))
    problems = "; ".join(f"{k.split('_')[0]}: {env[k]}" for k in ("cupy_error", "torch_error") if k in env)
    out = [f"## {title}", "",
           f"GPU: {env.get('gpu', 'unknown')}" + (f" ({env['gpu_memory_GiB']} GiB)" if "gpu_memory_GiB" in env else "")
           + (f"; measured: {measured}" if measured else "") + "." + (f" PROBLEM: {problems}." if problems else ""),
           f"Versions: {versions}." if versions else "",
           f"Started {report['started']}; {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget.", "",
           "| step | result | s |", "|---|---|---:|"]
    for step in report["steps"]:
        detail = f": {step['detail']}" if step["detail"] else ""
        out.append(f"| {step['step']} | {step['status']}{detail} | {step['seconds']:.1f} |")
    if report["checks"]:
        out += ["", "| check | result | s | measured |", "|---|---|---:|---|"]
        for c in report["checks"]:
            seconds = "-" if c.get("seconds") is None else f"{c['seconds']:.1f}"
            out.append(f"| {c['check']} | {c['status']} | {seconds} | {check_detail(c)} |")
    if s["rows"]:
        out += ["", "| | npqwen float16 | HF float16 | HF bfloat16 | the GPU's limit |", "|---|---:|---:|---:|---:|"]
        for r in s["rows"]:
            cells = [cell(v, r["unit"]) for v in r["values"]] + [cell(r["limit"], r["unit"])]
            out.append(f"| {r['label']} | " + " | ".join(cells) + " |")
        out += ["", "The GPU's limit: decode, its measured bandwidth over the bytes of the weights read per token; "
                "prefill, its measured float16 matrix rate over the FLOPs per token; serving, that rate over the "
                "workload's linear-layer FLOPs."]
    return "\n".join(out)


def check_detail(c) -> str:
    """The check's one line: what it measured, or why it failed (its printed lines are in the JSON)."""
    return c.get("detail", "").replace("|", "\\|")[:200]


def cell(value, unit="") -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if unit == "ms" or value < 1000 else f"{value:,.0f}"


if __name__ == "__main__":
    sys.exit(main())
