"""The command: its flags (the common ones here, each suite's in its module), the worker processes
(one per engine; the one-sequence suites once per round), and the report they make."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import tools.bench
from npqwen.tiny import BUILTIN
from tools.bench import SUITES
from tools.bench.engines import ENGINES, KNOWN_ENGINES, builtin_checkpoint, default_checkpoint, load_engine
from tools.bench.machine import bandwidth_probe, machine, measure_device, measure_matmul, merge_machine, peak_rss_bytes
from tools.bench.report import figures, markdown, table

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=tools.bench.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory, or a built-in model (tiny, tiny-moe) for a quick try "
                                   "(default: a random Qwen3-0.6B-shape one, built once)")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated, from {', '.join(KNOWN_ENGINES)} (default: {','.join(ENGINES)})")
    p.add_argument("--suites", default="prefill,decode",
                   help=f"comma-separated, from {', '.join(SUITES)}; or all (every one but moe, which runs alone)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each prefill and step; the best counts")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times, alternating; each figure's best counts "
                        "(the one-sequence suites only: decode, batch1, prefill, step, moe)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS threads = torch threads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", help="npqwen compute dtype (cuda: float16 or float32)")
    p.add_argument("--hf-device", help="torch device of the HF engines (default: --device); cpu beside a device "
                                       "'cuda' that is the strict CuPy stand-in (tools/cuda_check.sh --dry-run)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--markdown", action="store_true", help="print the table for docs/speed.md")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    for suite in SUITES.values():
        suite.add_arguments(p.add_argument_group(f"the {suite.NAME} suite"))
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(KNOWN_ENGINES)
    if unknown:
        p.error(f"unknown engine(s) {', '.join(sorted(unknown))}")
    suites = set(SUITES) - {"moe", "hybrid", "finetune", "scale_out"} if args.suites == "all" else {s for s in args.suites.split(",") if s}
    if suites - set(SUITES):
        p.error(f"unknown suite(s) {', '.join(sorted(suites - set(SUITES)))}; choose from {', '.join(SUITES)}")
    for name in list(suites):
        suites.update(SUITES[name].NEEDS)
    args.suites = suites
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0

    if "moe" in suites and suites != {"moe"}:
        p.error("the moe suite runs on a Qwen3-MoE checkpoint of its own: run it alone, --suites moe")
    own = all(getattr(SUITES[s], "OWN_MODEL", False) for s in suites)   # (the embed suite alone needs no --model)
    if "hybrid" in suites and suites != {"hybrid"}:
        p.error("the hybrid suite runs on a Qwen3.5 checkpoint of its own: run it alone, --suites hybrid")
    model = Path(args.model).resolve() if args.model else None if own else \
        default_checkpoint(moe="moe" in suites, hybrid="hybrid" in suites)
    if args.model in BUILTIN:   # written once as a checkpoint, which every engine loads
        model = builtin_checkpoint(args.model)
    if model is not None and not (model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there; give a checkpoint directory or a built-in model "
                f"({', '.join(BUILTIN)})")
    if "moe" in suites and json.loads((model / "config.json").read_text()).get("model_type") != "qwen3_moe":
        p.error(f"--suites moe needs a Qwen3-MoE checkpoint (model_type qwen3_moe); {model} is not one")
    report = {"machine": machine(args), "checkpoint": str(model), "rounds": args.rounds,
              "suites": [s for s in SUITES if s in suites], "engines": {}}
    single = [s for s in SUITES.values() if s.NAME in suites and s.WORKER == "single"]
    if single:
        runs = {engine: [] for engine in engines}
        for r in range(args.rounds):
            for engine in engines:
                print(f"[bench] round {r + 1}/{args.rounds}: {engine} ...", file=sys.stderr, flush=True)
                runs[engine].append(spawn_worker(engine, model, argv, args, [s.NAME for s in single]))
        for engine, results in runs.items():
            report["engines"][engine] = best_of(results)
        merge_machine(report["machine"], report["engines"].get("npqwen", {}).pop("machine", {}))
    serving = [s for s in SUITES.values() if s.NAME in suites and s.WORKER == "serving"]
    if serving:
        report["serving"] = run_serving(model, argv, args, engines, serving)
        merge_machine(report["machine"], report["serving"].pop("machine", {}))
    report["figures"] = figures(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(markdown(report) if args.markdown else table(report))
    failed = {**{e: r["error"] for e, r in report["engines"].items() if "error" in r},
              **report.get("serving", {}).get("errors", {})}
    for engine, error in failed.items():   # a table with holes is not a result: say why, exit 1
        print(f"[bench] {engine} failed: {error}", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------------- the workers

def spawn_worker(engine: str, model: Path, argv: list[str], args, suites: list[str]) -> dict:
    """Run `suites` on one engine in a process of its own: this command line again, as a worker.
    Its result, or {"error": its last line of stderr}."""
    env = {**os.environ, **{v: str(args.threads) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                            "MKL_NUM_THREADS")},
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    cmd = [sys.executable, "-m", "tools.bench", *argv, "--worker", engine, "--model", str(model),
           "--threads", str(args.threads), "--suites", ",".join(suites)]   # later flags win
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if args.profile and result.stderr:   # the step suite's profile tables
        print(result.stderr, file=sys.stderr)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_worker(args) -> dict:
    """Load one engine, then run this worker's suites; runs in its own process."""
    import time

    mine = [s for s in SUITES.values() if s.NAME in args.suites and s.runs_on(args.worker, args)]
    if all(getattr(s, "OWN_MODEL", False) for s in mine):   # suites that load a checkpoint of their own
        out = {}
        for suite in mine:
            out.update(suite.run(args.worker, args, None))
        return out
    started = time.perf_counter()
    engine = load_engine(args)
    out = {"load_s": time.perf_counter() - started, **engine.sizes}
    single = [s for s in mine if s.WORKER == "single"]
    if single:
        out.update(one_sequence(engine, args, single))
    for suite in mine:
        if suite.WORKER == "serving":
            out.update(suite.run(engine, args, None))
    out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def one_sequence(engine, args, suites) -> dict:
    """The one-sequence suites, after a warm-up, on prompts from one generator; for npqwen the
    machine's figures too: on the CPU measured with npqwen's own arrays, around and during its own
    runs; on the GPU its own limits, measured with CuPy before the runs."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = {}
    on_cpu = engine.name == "npqwen" and args.device == "cpu"
    if on_cpu:
        engine.probe = bandwidth_probe(engine.llm.weights)   # decode runs it every 8 steps
        matmul = measure_matmul(engine.llm.weights)
    if engine.name == "npqwen" and args.device == "cuda":
        out["machine"] = measure_device(engine.model.xp, engine.model.dtype)
    engine.prefill(rng.integers(0, engine.vocab_size, 16).tolist(), capacity=16)   # warm-up
    for suite in suites:
        out.update(suite.run(engine, args, rng))
    if on_cpu:
        out["machine"] = {"matmul_GFLOPs": max(matmul, measure_matmul(engine.llm.weights))}
        if engine.bandwidth:
            out["machine"]["bandwidth_GBps"] = sorted(engine.bandwidth)[len(engine.bandwidth) // 2]
    return out


def best_of(results: list[dict]) -> dict:
    """Each figure's best over the rounds: the highest rate, the lowest time and memory."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    best = dict(ok[0])
    for r in ok[1:]:
        for k, v in r.items():
            if k == "machine":
                best[k] = {m: max(best[k][m], v[m]) for m in v}
            elif k.endswith("_tps"):
                best[k] = max(best[k], v)
            elif k in ("load_s", "peak_rss_bytes") or k.startswith("step_") or (k.startswith("moe_") and
                                                                                k.endswith("_s")):
                best[k] = min(best[k], v)
    return best


def run_serving(model: Path, argv, args, engines, suites) -> dict:
    """The serving-worker suites: one worker per engine, run once; their results gathered."""
    out = {"workload": SUITES["serving"].workload(args), "runs": {}, "errors": {}}
    for engine in engines:
        names = [s.NAME for s in suites if s.runs_on(engine, args)]
        if not names:
            continue
        print(f"[bench] {'/'.join(names)}: {engine} ...", file=sys.stderr, flush=True)
        result = spawn_worker(engine, model, argv, args, names)
        if "error" in result:
            out["errors"][engine] = result["error"]
            continue
        out["runs"].update(result.get("serving", {}))
        out.setdefault("embed", {}).update(result.get("embed", {}))
        for key in ("memory", "prefix", "machine"):
            if key in result:
                out[key] = result[key]
    return out
