"""The `npqwen` command, run for real in a subprocess, including every bad-input case."""
import os
import re
import shutil
import subprocess
import sys

import pytest

import npqwen

from conftest import ROOT


def run(*args, stdin=None, env=None, timeout=300):
    result = subprocess.run([sys.executable, "-m", "npqwen", *args], input=stdin, capture_output=True,
                            timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})
    out = result.stdout.decode("utf-8", "replace")
    err = result.stderr.decode("utf-8", "replace")
    print(f"$ npqwen {' '.join(map(str, args))}\n{out}\n{err}")
    return result.returncode, out, err


def prompt_tokens(stderr):
    return [int(n) for n in re.findall(r"prompt: (\d+) tokens", stderr)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The built-in tiny model written as a Hugging Face checkpoint directory."""
    return npqwen.load("tiny").save(tmp_path_factory.mktemp("cli_tiny"))


def test_console_script_is_installed():
    assert shutil.which("npqwen") or pytest.skip("npqwen is not installed as a console script (pip install -e .)")
    result = subprocess.run(["npqwen", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "generate" in result.stdout and "chat" in result.stdout


def test_generate_streams_and_reports(tiny_dir):
    code, out, err = run("generate", "--model", str(tiny_dir), "--prompt", "Hello there", "-n", "12", "--seed", "1")
    assert code == 0 and out.strip()
    for line in ("load: ", "prompt: ", "tokens/s", "generation: 12 tokens", "peak memory: "):
        assert line in err


def test_generate_text_equals_the_python_api(tiny_dir):
    code, out, _ = run("generate", "--model", str(tiny_dir), "--prompt", "Hello", "--raw", "-t", "0", "-n", "16")
    assert code == 0
    assert out == npqwen.load(tiny_dir).generate("Hello", max_new_tokens=16, temperature=0).text + "\n"


def test_raw_and_no_think_change_the_prompt(tiny_dir):
    counts = {}
    for flag in ("--raw", "--no-think", None):
        code, _, err = run("generate", "--model", "tiny", "--prompt", "Hi", "-n", "1", *([flag] if flag else []))
        assert code == 0
        counts[flag] = prompt_tokens(err)[0]
    llm = npqwen.load("tiny")
    assert counts["--raw"] == 2
    assert counts[None] == len(llm.tokenizer.encode(llm.chat_prompt("Hi")))
    assert counts["--no-think"] == len(llm.tokenizer.encode(llm.chat_prompt("Hi", enable_thinking=False)))


def test_stop_string_and_prompt_from_stdin():
    code, out, err = run("generate", "--model", "tiny", "--prompt", "-", "--raw", "-t", "0", "-n", "30",
                         "--stop", "\x02", stdin="Tell me 你好".encode())
    assert code == 0 and prompt_tokens(err) == [len("Tell me 你好".encode())]


def test_chat_keeps_history_and_resets():
    code, out, err = run("chat", "--model", "tiny", "-n", "4", "--seed", "0",
                         stdin=b"first question\nsecond question\n/reset\nsecond question\n/exit\n")
    assert code == 0 and "(history cleared)" in err and "/reset" in err
    first, second, after_reset = prompt_tokens(err)
    assert second > first + 4          # the first turn (question and answer) is in the second prompt
    assert after_reset == len(npqwen.load("tiny").tokenizer.encode(npqwen.load("tiny").chat_prompt("second question")))


def test_chat_ends_on_eof():
    code, _, err = run("chat", "--model", "tiny", "-n", "2", stdin=b"hello\n")
    assert code == 0 and len(prompt_tokens(err)) == 1


def test_model_from_the_hf_cache(tiny_dir, tmp_path):
    snapshot = tmp_path / "models--Org--Tiny-Qwen3" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_dir, snapshot)
    (tmp_path / "models--Org--Tiny-Qwen3" / "refs").mkdir()
    (tmp_path / "models--Org--Tiny-Qwen3" / "refs" / "main").write_text("0123abcd")
    code, _, err = run("generate", "--model", "Org/Tiny-Qwen3", "--prompt", "Hi", "-n", "2",
                       env={"HF_HUB_CACHE": str(tmp_path)})
    assert code == 0 and "generation: 2 tokens" in err
    code, _, err = run("generate", "--model", "Org/Tiny-Qwen3", "--prompt", "Hi", "-n", "2",
                       env={"HF_HUB_CACHE": "", "HF_HOME": str(tmp_path.parent / "nohome"),
                            "HF_HUB_OFFLINE": "1"})
    assert code == 1 and "hf download Org/Tiny-Qwen3" in err


BAD = {
    "missing model dir": (["generate", "--model", "/no/such/dir", "--prompt", "hi"], "does not exist"),
    "negative temperature": (["generate", "--model", "tiny", "--prompt", "hi", "-t", "-1"], "temperature must be"),
    "top_p above 1": (["generate", "--model", "tiny", "--prompt", "hi", "--top-p", "2"], "top_p must be in"),
    "negative top_k": (["generate", "--model", "tiny", "--prompt", "hi", "--top-k", "-1"], "top_k must be"),
    "zero max tokens": (["generate", "--model", "tiny", "--prompt", "hi", "-n", "0"], "max_new_tokens"),
    "min_p above 1": (["generate", "--model", "tiny", "--prompt", "hi", "--min-p", "3"], "min_p must be"),
    "prompt too long": (["generate", "--model", "tiny", "--raw", "--prompt", "x" * 5000], "no room to generate"),
    "float16 on cpu": (["generate", "--model", "tiny", "--prompt", "hi", "--dtype", "float16"], "float16"),
    "bad utf-8 prompt": (["generate", "--model", "tiny", "--prompt", b"caf\xe9 \xff".decode("utf-8", "surrogateescape")],
                         "not valid UTF-8"),
    "hub id not cached": (["generate", "--model", "Nobody/Nothing-0B", "--prompt", "hi"], "hf download"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_clear_line(case):
    args, message = BAD[case]
    code, _, err = run(*args, env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": "/nonexistent-cache"})
    assert code == 1
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("npqwen: error:") and message in lines[0], err


def test_bad_utf8_on_stdin():
    code, _, err = run("generate", "--model", "tiny", "--prompt", "-", stdin=b"\xff\xfe bad")
    assert code == 1 and "not valid UTF-8" in err and "Traceback" not in err


def test_cuda_without_cupy_is_a_clear_error():
    from npqwen.backend import cuda_available

    if cuda_available():
        pytest.skip("a GPU is available here")
    code, _, err = run("generate", "--model", "tiny", "--prompt", "hi", "--device", "cuda")
    assert code == 1 and "cuda" in err and "Traceback" not in err


def test_argument_errors_are_argparse_usage():
    code, _, err = run("generate", "--model", "tiny", "--prompt", "hi", "--temperature", "warm")
    assert code == 2 and "invalid float value" in err and "Traceback" not in err
