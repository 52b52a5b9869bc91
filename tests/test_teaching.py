"""inspect, trace, compare, attention pictures, the tiny model and the walkthrough."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import npqwen
from npqwen.trace import Trace

from conftest import EMBEDDING_SMALL, ROOT, doc_samples, run_doc_line, run_doc_python, tiny_config, write_npqwen_checkpoint
from tolerance import model_tolerance

STEPS = ["self_attn.q_rope", "self_attn.k_rope", "self_attn.attn_probs", "self_attn.attn_output",
         "attn_residual", "mlp.act_fn"]   # named intermediate steps, besides the weighted modules


def run(*args, env=None, stdin=None):
    result = subprocess.run([sys.executable, "-m", "npqwen", *args], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})}, input=stdin, timeout=600)
    print(result.stdout[-3000:], result.stderr[-3000:])
    return result


def expected_trace_names(llm) -> list[str]:
    """HF module names that carry weights (weight name minus '.weight'), plus the named steps, in order."""
    names = ["model.embed_tokens", "model.rotary_emb.cos", "model.rotary_emb.sin"]
    for i in range(llm.config.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm"] + [f"{p}.self_attn.{m}" for m in
                                             ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "q_rope", "k_rope",
                                              "attn_probs", "attn_output", "o_proj")]
        names += [f"{p}.attn_residual", f"{p}.post_attention_layernorm"]
        names += [f"{p}.mlp.{m}" for m in ("gate_proj", "up_proj", "act_fn", "down_proj")] + [p]
    return names + ["model.norm", "lm_head"]


def test_trace_names_are_the_hf_modules_with_weights_plus_the_steps():
    llm = npqwen.load("tiny")
    trace = Trace()
    llm.forward(llm.tokenizer.encode("Hello"), recorder=trace)
    assert list(trace) == expected_trace_names(llm)
    weighted = {n[:-len(".weight")] for n in llm.weights}
    steps = {n for n in trace if not any(n.endswith(s) for s in STEPS)
             and not n.startswith("model.rotary_emb") and not re.fullmatch(r"model\.layers\.\d+", n)}
    assert steps == weighted


def test_trace_names_match_hf_module_names(tmp_path):
    """Every HF module that carries weights appears in the trace under the same name."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    llm = npqwen.load("tiny")
    hf = transformers.Qwen3ForCausalLM.from_pretrained(llm.save(tmp_path / "tiny"))
    with_weights = {name for name, module in hf.named_modules() if list(module.parameters(recurse=False))}
    trace = Trace()
    llm.forward([1, 2, 3], recorder=trace)
    assert with_weights <= set(trace), with_weights - set(trace)


def test_recorded_arrays_are_not_changed_afterwards():
    llm = npqwen.load("tiny")
    kept, copies = {}, {}

    def recorder(name, a):
        kept[name], copies[name] = a, np.array(a, copy=True)

    llm.forward(llm.tokenizer.encode("Hello there"), recorder=recorder)
    changed = [n for n in kept if not np.array_equal(kept[n], copies[n])]
    assert not changed, f"modified after recording: {changed}"


def test_trace_command_prints_every_step_and_saves_npz(tmp_path):
    out = tmp_path / "trace.npz"
    result = run("trace", "--model", "tiny", "--prompt", "Hello, world", "--save", str(out))
    assert result.returncode == 0
    llm = npqwen.load("tiny")
    names = expected_trace_names(llm)
    printed = [line.split()[0] for line in result.stdout.splitlines()[2:] if line.strip()]
    assert printed == names
    assert "(12, 4, 8)" in result.stdout and "float32" in result.stdout   # shape and dtype of q_norm etc.
    saved = np.load(out)
    assert list(saved.keys()) == names
    trace = Trace()
    llm.forward(llm.tokenizer.encode("Hello, world"), recorder=trace)
    for name in names:
        np.testing.assert_array_equal(saved[name], trace[name])


def test_trace_layers_filter():
    result = run("trace", "--model", "tiny", "--prompt", "Hi", "--layers", "1")
    assert result.returncode == 0
    assert "model.layers.1.self_attn.q_proj" in result.stdout and "model.layers.0." not in result.stdout
    assert "model.embed_tokens" in result.stdout and "lm_head" in result.stdout


def test_trace_on_a_checkpoint(npqwen_tiny_dir, tmp_path):
    import shutil

    ckpt = shutil.copytree(npqwen_tiny_dir, tmp_path / "ckpt")
    npqwen.load("tiny").tokenizer.save(ckpt)
    result = run("trace", "--model", str(ckpt), "--prompt", "abc", "--layers", "0-1")
    assert result.returncode == 0 and "model.layers.2.self_attn" not in result.stdout


def test_plot_attention_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "attention.png"
    result = run("trace", "--model", "tiny", "--prompt", "The cat sat", "--plot-attention", str(out),
                 "--layer", "1", "--head", "2")
    assert result.returncode == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.image
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    result = run("trace", "--model", "tiny", "--prompt", "The cat", "--plot-attention", str(out), "--layer", "0")
    assert result.returncode == 0 and "mean of 4 heads" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--layers", "7"], "the model has layers 0 .. 1"), (["--layers", "a-b"], "use layer numbers"),
    (["--plot-attention", "x.png"], "--plot-attention needs --layer"),
    (["--plot-attention", "x.png", "--layer", "0", "--head", "9"], "--head must be between 0 and 3"),
])
def test_trace_bad_arguments(args, message):
    result = run("trace", "--model", "tiny", "--prompt", "Hi", *args)
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_without_matplotlib_or_torch_the_message_says_what_to_install(tmp_path):
    for package in ("matplotlib", "torch"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('{package} hidden by the test')")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = run("trace", "--model", "tiny", "--prompt", "Hi", "--plot-attention", str(tmp_path / "a.png"),
                 "--layer", "0", env=env)
    assert result.returncode == 1 and "needs matplotlib: pip install" in result.stderr
    result = run("compare", "--model", "tiny", "--prompt", "Hi", env=env)
    assert result.returncode == 1 and "needs torch and transformers: pip install" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def hf_tiny_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from conftest import build_hf_checkpoint

    path = build_hf_checkpoint(tmp_path_factory.mktemp("cmp"), tiny_config(), std=0.1)
    npqwen.load("tiny").tokenizer.save(path)   # any byte-level tokenizer with ids < 512 will do
    return path


def test_compare_within_tolerance_on_a_correct_model(hf_tiny_dir):
    from npqwen.compare import compare

    llm = npqwen.load(hf_tiny_dir)
    rows = compare(llm, llm.tokenizer.encode("Hello, compare!"))
    worst = max(r["max_abs_diff"] for r in rows)
    print(f"{len(rows)} steps compared, largest |diff| {worst:.2e}")
    # npqwen compare's own bar (1e-3 relative, its default tol), far above float32's for this 2-layer model
    assert len(rows) == len(expected_trace_names(llm)) and all(r["ok"] for r in rows) and worst <= 1e-3


@pytest.mark.parametrize("corrupt", ["model.layers.1.mlp.up_proj.weight", "model.layers.2.self_attn.k_norm.weight",
                                     "model.layers.0.self_attn.v_proj.weight"])
def test_compare_points_at_a_corrupted_weight(hf_tiny_dir, corrupt):
    from npqwen.compare import compare

    llm = npqwen.load(hf_tiny_dir)
    llm.weights[corrupt][0] += 0.5            # in place: a view into the fused matrix where there is one
    rows = compare(llm, llm.tokenizer.encode("Hello, compare!"))
    first = next(r for r in rows if not r["ok"])
    assert first["name"] == corrupt[:-len(".weight")], first


def test_compare_command(hf_tiny_dir):
    result = run("compare", "--model", str(hf_tiny_dir), "--prompt", "Hi there")
    assert result.returncode == 0 and "all 59 steps within 0.001" in result.stdout   # 3 layers x 18 + 5
    result = run("compare", "--model", "tiny", "--prompt", "Hi there")
    assert result.returncode == 0 and "steps within" in result.stdout


def test_compare_summary_names_the_absolute_and_the_relative_difference_apart():
    from npqwen.compare import report

    # "a" has the largest |diff|; "b", on values below 1, the largest difference relative to them
    rows = [{"name": "a", "max_abs_diff": 3.1e-6, "max_abs_hf": 10.0, "ok": True},
            {"name": "b", "max_abs_diff": 1.3e-6, "max_abs_hf": 0.5, "ok": True}]
    text = report(rows, 1e-3)
    print(text)
    assert "largest max |diff| 3.100e-06 at a" in text and "largest relative difference 1.300e-06 at b" in text
    assert text.splitlines()[0].split() == ["module", "max", "|diff|", "max", "|HF|", "relative"]
    assert text.splitlines()[1].split() == ["a", "3.100e-06", "1.000e+01", "3.100e-07"]
    rows[1].update(max_abs_diff=0.02, ok=False)
    assert "first step past 0.001: b (max |diff| 2.000e-02, relative 2.000e-02)" in report(rows, 1e-3)


def test_compare_command_shows_no_loading_bar():
    result = run("compare", "--model", "tiny", "--prompt", "Hi there")
    assert result.returncode == 0 and "steps within" in result.stdout
    assert result.stderr == ""   # transformers' "Loading weights: 100%|..." bar is not shown


def test_inspect_qwen3_0_6b_shape(qwen3_0_6b_shape):
    result = run("inspect", "--model", str(qwen3_0_6b_shape))
    assert result.returncode == 0
    assert "unique parameters: 596,049,920" in result.stdout and "total parameters:  751,632,384" in result.stdout
    for name in ("model.embed_tokens.weight", "model.layers.27.mlp.down_proj.weight", "model.norm.weight"):
        assert name in result.stdout
    assert "[151936, 1024]" in result.stdout and "BF16" in result.stdout
    assert re.search(r"lm_head.weight\s+tied to model.embed_tokens.weight", result.stdout)
    for group in ("embed", "layers", "norm", "lm_head"):
        assert f"\n  {group}\n" in result.stdout


def test_inspect_counts_a_stored_tied_lm_head_once(tmp_path):
    from npqwen.checkpoint import read_safetensors_header, save_safetensors

    path = write_npqwen_checkpoint(tmp_path, tiny_config(), dtype="F32")
    tensors = {n: np.zeros(i.shape, np.float32) for n, i in read_safetensors_header(path / "model.safetensors").items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]   # as Qwen3-0.6B's file stores it
    save_safetensors(path / "model.safetensors", tensors)
    result = run("inspect", "--model", str(path))
    assert "stored, unused" in result.stdout
    unique = int(re.search(r"unique parameters: ([\d,]+)", result.stdout).group(1).replace(",", ""))
    total = int(re.search(r"total parameters:\s+([\d,]+)", result.stdout).group(1).replace(",", ""))
    assert total - unique == 512 * 64


def test_tiny_model_is_fixed_and_works_with_every_command():
    a, b = npqwen.load("tiny"), npqwen.load("tiny")
    assert all(np.array_equal(a.weights[n], b.weights[n]) for n in a.weights)
    assert a.config.hidden_size == 16 and a.config.num_hidden_layers == 2
    for args in (["inspect"], ["generate", "--prompt", "hi", "-n", "3"], ["trace", "--prompt", "hi"]):
        assert run(args[0], "--model", "tiny", *args[1:]).returncode == 0
    assert run("chat", "--model", "tiny", "-n", "2", stdin="hi\n/exit\n").returncode == 0


def test_walkthrough_code_samples_run(tmp_path):
    """Every ```python sample of docs/walkthrough.md, in order, as one script; every ```bash line too."""
    python, shell = doc_samples("walkthrough.md")
    assert len(python) >= 10 and len(shell) >= 2
    run_doc_python(python, tmp_path / "walkthrough.py")
    for line in shell:
        run_doc_line(line)
    result = run_doc_line(next(line for line in shell if "pdb" in line), check=False)
    assert "Breakpoint 1 at" in result.stdout and "(21, 16)" in result.stdout   # it stopped and printed shapes
    # the second breakpoint, named as model.py's frame sees it, stopped too; no pdb command failed
    assert "Breakpoint 2 at" in result.stdout and "((21, 4, 8), 0)" in result.stdout and "***" not in result.stdout


def test_walkthrough_breakpoints_stop_where_they_say(tmp_path):
    """pdb, fed its commands on stdin as the walkthrough's sample is, stops in each function the
    walkthrough names after `break`: the full names set at the first prompt (after the page's
    imports), the short ones once stopped in model.py; tiny runs, then tiny-moe (for moe.route).
    A breakpoint that cannot stop (on a docstring line) is never hit."""
    import npqwen.model
    from npqwen import moe, ops

    text = (ROOT / "docs" / "walkthrough.md").read_text(encoding="utf-8")
    assert not re.search(r"`break [\w/]+\.py:\d+`", text), "a file:line breakpoint goes stale; name the function"
    imports = re.findall(r"`(import npqwen[\w.]*)`", text)
    names = re.findall(r"`break ([\w.]+)`", text)
    full, short = [n for n in names if n.startswith("npqwen.")], [n for n in names if not n.startswith("npqwen.")]
    assert imports and full and short, (imports, names)
    script = tmp_path / "two_models.py"
    script.write_text('import npqwen\nfor m in ("tiny", "tiny-moe"):\n    npqwen.load(m).generate("Hi", max_new_tokens=1)\n')
    scope = {"npqwen": npqwen, "ops": ops, "moe": moe, "Qwen3": npqwen.model.Qwen3}
    for breaks, setup in [(full, imports), (short, ["import npqwen.model", "break npqwen.model.Qwen3.forward_batch",
                                                    "continue", "clear 1"])]:
        commands = setup + [f"break {n}" for n in breaks] + ["continue"] * 8 + ["break", "quit"]
        result = subprocess.run([sys.executable, "-m", "pdb", str(script)], input="\n".join(commands) + "\n",
                                capture_output=True, text=True, cwd=ROOT, timeout=120)
        out = result.stdout
        assert "***" not in out, out[-3000:]                  # no pdb command failed
        table = out[out.rindex("Num Type"):]                   # the last `break`: each breakpoint and its hits
        for name in breaks:
            code = eval(name, scope).__code__                  # pdb puts a function's breakpoint on its def line
            where = re.search(rf"at {re.escape(code.co_filename)}:{code.co_firstlineno}\n\t.* hit (\d+) time", table)
            assert where, f"pdb never stopped at `break {name}` ({code.co_filename}:{code.co_firstlineno}):\n{table}"


def test_bench_reports_every_figure(tmp_path, npqwen_tiny_dir):
    """The benchmark runs on a tiny checkpoint and reports each figure; it never asserts a time."""
    pytest.importorskip("transformers")
    cmd = [sys.executable, "-m", "tools.bench", "--model", str(npqwen_tiny_dir), "--prefill", "8,32",
           "--decode-prompts", "4,40", "--new-tokens", "6", "--repeats", "2", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for engine in ("npqwen", "hf-float32", "hf-bfloat16"):
        figures = report["engines"][engine]
        assert "error" not in figures, figures
        for key in ("load_s", "prefill_8_tps", "prefill_32_tps", "decode_4_tps", "decode_40_tps", "peak_rss_bytes"):
            assert figures[key] > 0, (engine, key)
    for key in ("bandwidth_GBps", "matmul_GFLOPs"):
        assert report["machine"][key] > 0
    for key in ("decode_bound_tps", "decode_pct_of_bound", "long_over_short_decode_pct", "decode_vs_hf-bfloat16",
                "decode_vs_hf-float32", "prefill_32_vs_hf-float32", "prefill_32_pct_of_matmul",
                "rss_over_weights_plus_kv"):
        assert report["figures"][key] > 0, key
    table = subprocess.run(cmd[:-1] + ["--markdown"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert table.returncode == 0 and "| decode tok/s (4-token prompt) |" in table.stdout


def test_bench_serving_reports_every_figure(npqwen_tiny_dir):
    """The serving suites and the step suite on a tiny checkpoint, at small sizes: every run and
    figure is there, the baselines count the same tokens for the same requests; it never asserts a time."""
    pytest.importorskip("transformers")
    from tools.bench.report import markdown, table

    cmd = [sys.executable, "-m", "tools.bench", "--model", str(npqwen_tiny_dir), "--threads", "1",
           "--suites", "batch1,serving,prefix,step", "--decode-prompts", "4,40", "--new-tokens", "6",
           "--serving-requests", "6", "--serving-sample", "4", "--serving-prompt-lens", "8-40",
           "--serving-output-lens", "2-8", "--serving-batch", "2", "--prefix-tokens", "256", "--prefix-requests", "3",
           "--step-prefill", "40", "--step-batch", "2", "--step-context", "20", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    serving = report["serving"]
    assert serving["errors"] == {}, serving["errors"]
    runs = serving["runs"]
    assert set(runs) == {"npqwen-engine", "npqwen-sequential", "hf-float32-static", "hf-bfloat16-static"}
    assert runs["npqwen-engine"]["requests"] == 6 and runs["npqwen-engine"]["preemptions"] == 0
    for name, run_ in runs.items():
        for key in ("total_s", "output_tps", "total_tps", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s"):
            assert run_[key] > 0, (name, key)
        if name != "npqwen-engine":   # the same first 4 requests: padding and extra tokens are not counted
            assert run_["requests"] == 4
            assert (run_["prompt_tokens"], run_["output_tokens"]) == (runs["npqwen-sequential"]["prompt_tokens"],
                                                                      runs["npqwen-sequential"]["output_tokens"])
    assert serving["prefix"]["cache_hit_tokens"] == 2 * 256       # the 2 later requests reuse the shared page
    assert serving["memory"]["kv_cache_tokens"] == 6 * 256        # every request at its longest: one page each
    assert report["engines"]["npqwen"]["batch1_40_tps"] > 0
    for key in ("batch1_short_pct_of_decode", "batch1_long_pct_of_decode", "serving_pct_of_linear_bound",
                "serving_rss_over_weights_plus_kv_pool", "prefix_cold_over_cached_ttft",
                "serving_output_tps_vs_hf-bfloat16-static", "serving_output_tps_vs_npqwen-sequential"):
        assert report["figures"][key] > 0, key
    for engine in ("npqwen", "hf-float32", "hf-bfloat16"):
        assert report["engines"][engine]["step_prefill_s"] > 0 and report["engines"][engine]["step_batch_s"] > 0
    for key in ("step_prefill_pct_of_matmul", "step_batch_pct_of_matmul", "step_prefill_vs_hf-float32",
                "step_batch_vs_hf-bfloat16"):
        assert report["figures"][key] > 0, key
    assert "| time to first token, p99 (s) |" in markdown(report)
    assert "| batched decode step (s) |" in markdown(report)
    assert "serving: linear-layer bound / engine's time" in table(report)


def test_bench_embed_suite_reports_every_figure(embedding_small):
    """The embed suite on a small embedding checkpoint: npqwen and sentence-transformers embed the same texts
    (the same tokens, nearly the same vectors), the padding is counted, every figure is there; no time asserted."""
    pytest.importorskip("sentence_transformers")
    from tools.bench.report import markdown

    cmd = [sys.executable, "-m", "tools.bench", "--suites", "embed", "--threads", "1", "--embed-texts", "5",
           "--embed-lens", "4-40", "--embed-model", str(embedding_small), "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    runs = report["serving"]["embed"]
    assert set(runs) == {"npqwen", "hf-float32", "hf-bfloat16"} and report["serving"]["errors"] == {}
    assert len({(r["texts"], r["tokens"]) for r in runs.values()}) == 1 and runs["npqwen"]["texts"] == 5
    # unit vectors of the small embedding model over at most 40 tokens: its float32 bar
    bound = model_tolerance(npqwen.Qwen3Config.from_dict(EMBEDDING_SMALL), 40)
    assert max(abs(a - b) for a, b in zip(runs["npqwen"]["first"], runs["hf-float32"]["first"])) <= bound
    st = runs["hf-float32"]
    assert st["padded_tokens"] >= st["tokens"] and st["unpadded_seconds"] > 0
    for key in ("embed_vs_hf-float32", "embed_vs_hf-bfloat16", "embed_st_unpadded_over_padded"):
        assert report["figures"][key] > 0, key
    assert "| texts/s |" in markdown(report) and "npqwen texts/s vs sentence-transformers float32" in markdown(report)


def test_bench_suites_are_modules_of_one_shape():
    """Every suite in the registry is a module with the parts the command and the report call, and
    --help lists each suite's flags; an unknown suite is refused with the list of them."""
    import inspect

    from tools.bench import SUITES

    for name, suite in SUITES.items():
        assert suite.NAME == name and suite.WORKER in ("single", "serving") and set(suite.NEEDS) <= set(SUITES)
        for part in ("add_arguments", "runs_on", "run", "figures", "rows", "tables", "notes"):
            assert inspect.isfunction(getattr(suite, part, None)), (name, part)
        assert all(len(target) == 4 for target in suite.TARGETS), name
    run = lambda *args: subprocess.run([sys.executable, "-m", "tools.bench", *args], capture_output=True,  # noqa: E731
                                       text=True, cwd=ROOT)
    help_text = run("--help").stdout
    for flag in ("--decode-prompts", "--prefill", "--serving-requests", "--prefix-tokens", "--step-batch", "--profile",
                 "--embed-texts"):
        assert flag in help_text, flag
    refused = run("--suites", "nope")
    assert refused.returncode == 2 and f"choose from {', '.join(SUITES)}" in refused.stderr


def test_bench_fails_loudly_and_takes_the_built_in_models(tmp_path):
    """A run that measured nothing exits non-zero; `--model tiny` is a quick try, written once as a checkpoint."""
    env = {**os.environ, "NPQWEN_CACHE": str(tmp_path / "cache")}
    run = lambda *args: subprocess.run([sys.executable, "-m", "tools.bench", "--engines", "npqwen",   # noqa: E731
                                        "--threads", "1", "--prefill", "8", "--decode-prompts", "4",
                                        "--new-tokens", "3", "--repeats", "1", *args],
                                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    missing = run("--model", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no config.json there" in missing.stderr, missing.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "qwen3"}')
    broken = run("--model", str(tmp_path / "broken"))
    assert broken.returncode == 1 and "[bench] npqwen failed:" in broken.stderr, broken.stderr
    tiny = run("--model", "tiny", "--json")
    assert tiny.returncode == 0, tiny.stderr
    assert json.loads(tiny.stdout)["engines"]["npqwen"]["decode_4_tps"] > 0
