"""The benchmark's hybrid suite runs on a small Qwen3.5 checkpoint and reports each figure; it never asserts a time."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_config

pytest.importorskip("transformers")


def test_bench_hybrid_suite_reports_every_figure(tmp_path):
    path = build_hybrid_checkpoint(tmp_path, hybrid_config())
    cmd = [sys.executable, "-m", "tools.bench", "--suites", "hybrid", "--model", str(path), "--threads", "1",
           "--hybrid-prompts", "8,70", "--hybrid-new-tokens", "3", "--hybrid-prefill", "40", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    for engine in ("npqwen", "hf-float32", "hf-bfloat16"):
        assert {"hybrid_decode_8_tps", "hybrid_decode_70_tps", "hybrid_prefill_40_tps"} <= set(report["engines"][engine])
    assert {"hybrid_decode_vs_hf-bfloat16", "hybrid_long_over_short_decode_pct",
            "hybrid_prefill_vs_hf-float32"} <= set(report["figures"])


def test_the_hybrid_suite_runs_alone():
    result = subprocess.run([sys.executable, "-m", "tools.bench", "--suites", "hybrid,decode"], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode != 0 and "the hybrid suite runs on a Qwen3.5 checkpoint of its own" in result.stderr
