"""The `npqwen` command, run for real in a subprocess, including every bad-input case."""
import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import npqwen

from conftest import ROOT


def run(*args, stdin=None, env=None, timeout=300, cwd=ROOT):
    env = {**os.environ, **(env or {})}
    if cwd != ROOT:   # `python -m npqwen` from another folder: the checkout must stay importable
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-m", "npqwen", *args], input=stdin, capture_output=True,
                            timeout=timeout, cwd=cwd, env=env)
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
    "missing model dir": (["generate", "--model", "/no/such/dir", "--prompt", "hi"], "no such directory"),
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


def one_error_line(code, err, message):
    """Exit status 1 and exactly one line on stderr: "npqwen: error: ..." that contains `message`."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("npqwen: error:") and message in lines[0], err


# Hardening: each mistake is found before the slow work (the load, the forward pass) and said in one line.
HIDDEN = 'raise ImportError("No module named {0} (hidden by the test)")\n'


@pytest.fixture
def without(tmp_path):
    """An environment in which importing the named packages fails, as if they were not installed."""
    def env(*packages):
        for name in packages:
            (tmp_path / "hidden" / name).mkdir(parents=True)
            (tmp_path / "hidden" / name / "__init__.py").write_text(HIDDEN.format(name))
        return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "hidden"), str(ROOT)])}
    return env


@pytest.mark.parametrize("args, message", [
    (["trace", "--prompt", "hi", "--save", "/nonexistent/dir/t.npz"], "no such directory '/nonexistent/dir'"),
    (["trace", "--prompt", "hi", "--plot-attention", "/nonexistent/dir/a.png", "--layer", "0"],
     "no such directory '/nonexistent/dir'"),
    (["trace", "--prompt", "hi", "--plot-attention", "a.png"], "--plot-attention needs --layer"),
    (["inspect", "--dtype", "bogus"], "dtype 'bogus' is not supported on cpu"),
    (["inspect", "--dtype", "float16"], "dtype 'float16' is not supported on cpu"),
    (["trace", "--prompt", "hi", "--dtype", "bogus"], "dtype 'bogus' is not supported"),
])
def test_outputs_and_dtype_are_checked_first(args, message):
    code, out, err = run(*args, "--model", "tiny")
    one_error_line(code, err, message)
    assert out == ""


def test_save_reports_the_file_it_wrote(tmp_path):
    code, _, err = run("trace", "--model", "tiny", "--prompt", "hi", "--save", str(tmp_path / "t"))
    assert code == 0 and f"to {tmp_path / 't.npz'}" in err and (tmp_path / "t.npz").is_file()


def test_plot_attention_without_matplotlib_fails_before_the_table(without):
    code, out, err = run("trace", "--model", "tiny", "--prompt", "hi", "--plot-attention", "a.png", "--layer", "0",
                         env=without("matplotlib"))
    one_error_line(code, err, "--plot-attention needs matplotlib: pip install 'npqwen[plot]'")
    assert out == ""


def test_compare_without_torch_pins_the_version(without):
    code, out, err = run("compare", "--model", "tiny", "--prompt", "hi", env=without("torch"))
    one_error_line(code, err, "pip install torch==2.13.0 transformers")
    assert out == ""


def test_output_the_terminal_cannot_encode_is_replaced(tmp_path):
    latin1 = {"PYTHONIOENCODING": "latin-1"}
    code, out, err = run("generate", "--model", "tiny", "--prompt", "hi", "-n", "200", "-t", "0", env=latin1)
    assert code == 0 and "Traceback" not in err and "generation: 200 tokens" in err
    path = tmp_path / "prompts.txt"
    path.write_text("你好\n", encoding="utf-8")
    code, out, err = run("generate", "--model", "tiny", "--prompts-file", str(path), "-n", "2", env=latin1)
    assert code == 0 and "Traceback" not in err and '"prompt": "??"' in out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("args", [["generate", "--prompt", "hi", "-n", "20"], ["inspect"],
                                  ["trace", "--prompt", "hi"], ["generate", "--prompts-file", "-", "-n", "2"],
                                  ["chat", "-n", "2"]])
def test_a_full_disk_is_one_line(args):
    with open("/dev/full", "wb") as full:
        result = subprocess.run([sys.executable, "-m", "npqwen", *args, "--model", "tiny"], input=b"hi\n",
                                stdout=full, stderr=subprocess.PIPE, timeout=300, cwd=ROOT)
    err = result.stderr.decode()
    if args[0] == "chat":   # the chat's greeting comes first, on stderr
        err = err.split("\n", 1)[1]
    one_error_line(result.returncode, err, "No space left on device")


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flag, value, message", [("-t", "-1", "temperature must be"),
                                                  ("--top-p", "2", "top_p must be"),
                                                  ("-n", "0", "max_new_tokens must be"),
                                                  ("--seed", "-3", "seed must be")])
def test_sampling_values_are_checked_before_the_model_is_looked_for(command, flag, value, message):
    # the model does not exist: an error about the value means the value was checked first
    args = ["--prompt", "hi"] if command == "generate" else []
    code, _, err = run(command, "--model", "/no/such/dir", *args, flag, value, stdin=b"hi\n")
    one_error_line(code, err, message)


def test_model_messages_say_what_is_wrong(tiny_dir, tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    code, _, err = run("generate", "--model", str(tiny_dir / "config.json"), "--prompt", "hi", env=offline)
    one_error_line(code, err, "is a file, not a checkpoint directory")
    (tmp_path / "models").mkdir()   # a mistyped relative path is not looked up as a hub id
    code, _, err = run("generate", "--model", "models/Qwen3-0.6B", "--prompt", "hi", env=offline, cwd=tmp_path)
    one_error_line(code, err, "no such directory: 'models/Qwen3-0.6B' (models/ exists")
    code, _, err = run("generate", "--model", "./Qwen3-0.6B", "--prompt", "hi", env=offline, cwd=tmp_path)
    one_error_line(code, err, "no such directory: './Qwen3-0.6B'")
    snapshot = tmp_path / "cache" / "models--Org--Partial" / "snapshots" / "0123abcd"   # a download cut short
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_dir / "config.json", snapshot)
    code, _, err = run("generate", "--model", "Org/Partial", "--prompt", "hi", env=offline)
    one_error_line(code, err, "only partly in the Hugging Face cache")
    assert "has no *.safetensors" in err and "`hf download Org/Partial`" in err
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_dir, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    for command in (["generate", "--prompt", "hi"], ["trace", "--prompt", "hi"], ["chat"]):
        code, _, err = run(*command, "--model", str(no_tokenizer), env=offline, stdin=b"hi\n")
        one_error_line(code, err, "needs the model's tokenizer.json and tokenizer_config.json")
        assert "token ids" not in err
    no_template = tmp_path / "no_template"
    shutil.copytree(tiny_dir, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    (no_template / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    code, _, err = run("chat", "--model", str(no_template), stdin=b"hi\n")
    one_error_line(code, err, "has no chat_template")
    assert "use a raw prompt" not in err


def test_chat_that_outgrows_the_context_names_the_history(tiny_dir, tmp_path):
    small = tmp_path / "small"
    shutil.copytree(tiny_dir, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 160}))
    code, _, err = run("chat", "--model", str(small), "-n", "120", "-t", "0",
                       stdin=b"hello\nhello\n/reset\nhello\n")
    assert code == 0 and "Traceback" not in err
    assert "the conversation has outgrown the context" in err and "/reset clears the history" in err
    assert "shorten the prompt" not in err
    assert len(prompt_tokens(err)) == 2   # the first turn, and the same question after /reset


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["generate", "--prompts-file", "-"], ["chat"],
                                     ["inspect"], ["trace", "--prompt", "hi"], ["compare", "--prompt", "hi"],
                                     ["serve", "--port", "0"]])
def test_an_empty_model_folder_names_every_missing_file(tmp_path, command):
    code, _, err = run(*command, "--model", str(tmp_path), stdin=b"hi\n")
    one_error_line(code, err, f"{tmp_path}: no config.json, no *.safetensors, no tokenizer.json")
    assert "hf download" in err
    (tmp_path / "config.json").write_text("{}")   # the weights alone missing: still named, with the tokenizer
    code, _, err = run(*command, "--model", str(tmp_path), stdin=b"hi\n")
    one_error_line(code, err, f"{tmp_path}: no *.safetensors, no tokenizer.json")


def test_a_hub_id_not_found_points_to_the_tiny_model_and_hf_download(tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    for command in (["generate", "--prompt", "hi"], ["inspect"]):
        code, _, err = run(*command, "--model", "Org/Missing", env=offline)
        one_error_line(code, err, "Org/Missing is not a local directory and not in the Hugging Face cache")
        assert "`hf download Org/Missing`" in err and "--model tiny" in err
        assert "pip install" not in err   # huggingface_hub comes with tokenizers: it is always there


def test_help_shows_every_default():
    from npqwen.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.dest in ("prompt", "prompts_file", "layer", "input",
                                                                          "text", "query", "document", "documents", "sae"):
                continue   # the required ones (--prompt or --prompts-file; --layer with --plot-attention; --input;
                           # embed's --text or --input; rerank's --query, and --document or --documents;
                           # features' --sae)
            assert action.help and "default" in action.help, f"npqwen {name} {action.option_strings}"
    code, out, _ = run("chat", "--help")
    assert code == 0 and "(default: 512)" in out and "(default: float32)" in out


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


def test_an_unknown_option_shows_the_commands_usage_and_the_nearest_option():
    code, _, err = run("generate", "--model", "tiny", "--prompt", "hi", "--temprature", "0.5")
    assert code == 2 and err.startswith("usage: npqwen generate") and "did you mean --temperature?" in err, err
    code, _, err = run("serve", "--model", "tiny", "--prot", "8001")
    assert code == 2 and err.startswith("usage: npqwen serve") and "did you mean --port?" in err, err


@pytest.mark.parametrize("args, fragments", [
    (("generate", "--model", "tiny", "-p", "hi", "--raw", "--system", "Be brief."),
     ["--system goes with the chat template, which --raw leaves out"]),
    (("generate", "--model", "tiny", "-p", "hi", "--stop", ""), ["stop cannot contain an empty string"]),
    (("generate", "--model", "tinyy", "-p", "hi"), ["no such directory: 'tinyy'", "did you mean 'tiny'"]),
    (("trace", "--model", "tiny", "-p", "hi", "--layer", "1"), ["--layer goes with --plot-attention", "--layers"]),
    (("trace", "--model", "tiny", "-p", "hi", "--head", "0"), ["--head goes with --plot-attention", "--layers"]),
    (("trace", "--model", "tiny", "-p", "hi", "--layers", "1", "--plot-attention", "attention.png"),
     ["--plot-attention needs --layer N", "--layers only chooses"]),
])
def test_options_that_would_be_ignored_or_mistyped_are_one_error(args, fragments, tmp_path):
    """Before: --raw dropped --system, --stop "" was taken, --model tinyy suggested nothing, trace's --layer
    without --plot-attention was ignored and --plot-attention's error did not name --layers."""
    code, _, err = run(*args, cwd=tmp_path)
    errors = [line for line in err.splitlines() if line.startswith("npqwen: error:")]
    assert code == 1 and len(errors) == 1 and all(f in errors[0] for f in fragments), err
    assert not (tmp_path / "attention.png").exists()


# --prompts-file: many prompts through one engine, JSONL out in input order

PROGRESS = re.compile(r"\] (\d+)/(\d+) done, \d+ tokens, [\d.]+ tokens/s, (ETA|took) \d+:\d\d:\d\d")


def jsonl(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("flags", [["--raw"], [], ["--no-think", "--system", "Be brief."]])
def test_prompts_file_in_input_order_equals_generate_alone(tmp_path, flags):
    prompts = ["Hello there", "The cat sat on the mat and looked around the room", "A", "你好, 世界", "Once"]
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts[:2]) + "\n\n  \n" + "\r\n".join(prompts[2:]) + "\n", encoding="utf-8")
    # a small engine: two requests at a time, prefill in chunks of 16 tokens, pages of 16 positions
    code, out, err = run("generate", "--model", "tiny", "--prompts-file", str(path), "-t", "0", "-n", "24",
                         "--max-batch-size", "2", "--max-batched-tokens", "16", "--page-size", "16", *flags)
    assert code == 0
    records = jsonl(out)
    assert [r["index"] for r in records] == list(range(len(prompts)))
    assert [r["prompt"] for r in records] == prompts          # blank lines skipped, "\r\n" endings dropped
    llm = npqwen.load("tiny")
    for r, prompt in zip(records, prompts):
        if "--raw" not in flags:
            system = [{"role": "system", "content": "Be brief."}] if "--system" in flags else []
            prompt = llm.chat_prompt(system + [{"role": "user", "content": prompt}],
                                     enable_thinking="--no-think" not in flags)
        alone = llm.generate(prompt, max_new_tokens=24, temperature=0)
        assert (r["text"], r["token_ids"], r["finish_reason"]) == (alone.text, alone.token_ids, alone.finish_reason)
        assert r["prompt_tokens"] == len(llm.tokenizer.encode(prompt))
        assert r["generated_tokens"] == len(alone.token_ids)
    assert PROGRESS.search(err).groups()[:2] == (str(len(prompts)), str(len(prompts)))


def test_jsonl_lines_override_the_command_line(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    lines = [{"prompt": "Hello", "max_new_tokens": 3},
             {"prompt": "Hello", "max_new_tokens": 11, "temperature": None},   # null: the command line's value
             {"messages": messages},
             {"prompt": "Hello", "top_k": 1, "temperature": 0.9, "seed": 5}]   # top-k 1 is greedy too
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line, ensure_ascii=False) for line in lines) + "\n\n", encoding="utf-8")
    code, out, _ = run("generate", "--model", "tiny", "--prompts-file", str(path), "-t", "0", "-n", "7", "--raw")
    assert code == 0
    records = jsonl(out)
    assert [r["generated_tokens"] for r in records] == [3, 11, 7, 7]
    assert records[2]["messages"] == messages and "prompt" not in records[2]
    llm = npqwen.load("tiny")
    long = llm.generate("Hello", max_new_tokens=11, temperature=0)   # --raw: "prompt" lines are used as is
    assert records[0]["token_ids"] == long.token_ids[:3] and records[1]["token_ids"] == long.token_ids
    assert records[3]["token_ids"] == long.token_ids[:7]
    chat = llm.generate(llm.chat_prompt(messages), max_new_tokens=7, temperature=0)   # messages: always templated
    assert records[2]["text"] == chat.text


def test_jsonl_prompt_follows_raw_and_stdin_works():
    lines = b'{"prompt": "Hi", "max_new_tokens": 1}\n{"prompt": "Hi", "max_new_tokens": 1}\n'
    code, out, _ = run("generate", "--model", "tiny", "--prompts-file", "-", stdin=lines)
    code_raw, out_raw, _ = run("generate", "--model", "tiny", "--prompts-file", "-", "--raw", stdin=lines)
    assert code == code_raw == 0
    llm = npqwen.load("tiny")
    assert [r["prompt_tokens"] for r in jsonl(out)] == [len(llm.tokenizer.encode(llm.chat_prompt("Hi")))] * 2
    assert [r["prompt_tokens"] for r in jsonl(out_raw)] == [2, 2]


@pytest.mark.parametrize("command", ["generate", "embed"])
def test_a_jsonl_file_with_one_bad_line_is_an_error(tmp_path, command):
    path = tmp_path / "mixed.jsonl"
    first = '{"prompt": "a"}' if command == "generate" else '{"text": "a"}'
    path.write_text(f'{first}\n{{prompt: "b"}}\n', encoding="utf-8")
    source = ["--prompts-file", str(path), "-n", "2"] if command == "generate" else ["--input", str(path)]
    code, out, err = run(command, "--model", "tiny", *source)
    assert code == 1 and out == "" and f"{path} line 2: not valid JSON" in err and "Traceback" not in err


def test_a_file_whose_first_line_is_text_is_plain_text(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_text('not json\n{"prompt": "a"}\n', encoding="utf-8")
    code, out, err = run("generate", "--model", "tiny", "--prompts-file", str(path), "--raw", "-n", "2")
    assert code == 0 and [r["prompt"] for r in jsonl(out)] == ["not json", '{"prompt": "a"}']


def test_output_file_and_progress_on_stderr(tmp_path):
    path, output = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    path.write_text("one\ntwo\nthree\n", encoding="utf-8")
    code, out, err = run("generate", "--model", "tiny", "--prompts-file", str(path), "--output", str(output),
                         "-n", "5", "--seed", "0")
    assert code == 0 and out == ""
    records = jsonl(output.read_text(encoding="utf-8"))
    assert [(r["index"], r["prompt"]) for r in records] == [(0, "one"), (1, "two"), (2, "three")]
    assert set(records[0]) == {"index", "prompt", "text", "token_ids", "finish_reason", "prompt_tokens",
                               "generated_tokens"}
    assert PROGRESS.search(err).groups() == ("3", "3", "took")   # not a terminal: plain lines, the last at the end
    assert "\r" not in err and f"wrote 3 results to {output}" in err
    for line in ("load: ", "prompts: 3, ", "generation: ", "peak memory: "):
        assert line in err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_one_line_on_a_terminal(monkeypatch):
    from npqwen.cli import progress as module

    monkeypatch.setattr(module, "TERMINAL_EVERY", 0)   # every show() redraws
    stream = Terminal()
    with module.Progress(items=2, work=20, stream=stream) as progress:
        progress.advance(2)
        progress.show()
        progress.advance(8)
        progress.finish_one(0)
        progress.advance(3)
        progress.finish_one(7)              # stopped 7 tokens short of its max_new_tokens
        progress.show()
    text = stream.getvalue()
    assert text.startswith("\r[") and text.endswith("\n") and text.count("\n") == 1, repr(text)
    lines = [line.strip() for line in text.strip("\n").split("\r")[1:]]
    assert lines[0] == "[....................] 0/2 done, 0 tokens, 0.0 tokens/s, ETA ?"
    assert lines[1].startswith("[##..................] 0/2 done, 2 tokens, ") and "ETA 0:00:" in lines[1]
    assert all(line.startswith("[####################] 2/2 done, 13 tokens, ") and "took 0:00:" in line
               for line in lines[2:]), lines


def test_progress_in_a_log_is_a_plain_line_every_few_seconds(monkeypatch):
    from npqwen.cli import progress as module

    stream = io.StringIO()                    # not a terminal
    with module.Progress(items=3, work=30, stream=stream) as progress:
        for _ in range(3):                    # all within a second: no line between the first and the last
            progress.advance(10)
            progress.finish_one(0)
            progress.show()
    assert "\r" not in stream.getvalue()
    [last] = stream.getvalue().splitlines()   # the one at the end
    assert last.startswith("[####################] 3/3 done, 30 tokens, ")
    assert PROGRESS.search(last).groups() == ("3", "3", "took")
    monkeypatch.setattr(module, "LOG_EVERY", 0)
    stream = io.StringIO()
    with module.Progress(items=2, work=20, stream=stream) as progress:
        progress.advance(5)
        progress.show()                       # its interval has passed: a line of its own
    lines = stream.getvalue().splitlines()    # at the start, at show(), at the end
    assert len(lines) == 3 and "0/2 done, 0 tokens" in lines[0] and all("0/2 done, 5 tokens" in x for x in lines[1:])
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt), module.Progress(items=2, work=20, stream=stream) as progress:
        progress.advance(5)
        progress.show()
        raise KeyboardInterrupt               # the error's own line is the last: no closing progress line
    assert len(stream.getvalue().splitlines()) == 2
    stream = Terminal()
    with pytest.raises(KeyboardInterrupt), module.Progress(items=2, work=20, stream=stream) as progress:
        raise KeyboardInterrupt               # on a terminal the line is wiped, and no newline left after it
    assert stream.getvalue().endswith("\r") and stream.getvalue().split("\r")[-2].strip() == ""


def test_prompts_file_progress_on_a_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect", reason="pexpect is not installed (the test extra)")
    path, output = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    path.write_text("one\ntwo\nthree\n", encoding="utf-8")
    # 3 x 2,000 greedy tokens of the tiny model: about a second, so the line is redrawn on the way
    screen = pexpect.spawn(sys.executable, ["-m", "npqwen", "generate", "--model", "tiny", "--raw", "-t", "0",
                                            "-n", "2000", "--prompts-file", str(path), "--output", str(output)],
                           cwd=str(ROOT), encoding="utf-8", timeout=120, dimensions=(40, 200))
    screen.expect(pexpect.EOF)
    screen.close()
    text = screen.before
    print(repr(text))
    assert screen.exitstatus == 0 and len(jsonl(output.read_text(encoding="utf-8"))) == 3
    bar, stats = text.split("\r\n==========\r\n")
    assert "\n" not in bar                     # one line, redrawn in place
    draws = [PROGRESS.search(draw) for draw in bar.split("\r")[1:]]
    assert draws[0] is None and "0/3 done, 0 tokens" in bar.split("\r")[1]
    assert draws[-1].groups() == ("3", "3", "took") and "6000 tokens" in bar.split("\r")[-1]
    assert any(d is not None and d.group(3) == "ETA" for d in draws), "no redraw on the way"
    assert "generation: 6000 tokens" in stats


BAD_FILES = {   # file bytes -> what the one error line says (after "npqwen: error: FILE")
    "empty": (b"", ": no prompts in it (the file is empty)"),
    "only blank lines": (b"\n  \n\r\n", ": no prompts in it (every line is blank)"),
    "invalid utf-8": (b"fine\n\ncaf\xe9\n", " line 3: not valid UTF-8"),
    "neither prompt nor messages": (b'{"prompt": "a"}\n{"max_new_tokens": 3}\n', ' line 2: needs "prompt"'),
    "prompt and messages": (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}\n',
                            ' line 1: needs "prompt" (a string) or "messages" (a list of chat messages), not both'),
    "prompt not a string": (b'{"prompt": ["a"]}\n', ' line 1: "prompt" must be a string'),
    "messages not a list": (b'{"messages": "hi"}\n', ' line 1: "messages" must be'),
    "unknown field": (b'{"prompt": "a"}\n{"prompt": "b", "max_tokens": 4}\n', " line 2: unknown field 'max_tokens'"),
    "bad temperature": (b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c", "temperature": -1}\n',
                        " line 3: temperature must be"),
    "top_k not an integer": (b'{"prompt": "a", "top_k": 2.5}\n', " line 1: top_k must be"),
    "zero max_new_tokens": (b'{"prompt": "a"}\n\n{"prompt": "b", "max_new_tokens": 0}\n', " line 3: max_new_tokens"),
    "stop not strings": (b'{"prompt": "a", "stop": [1]}\n', " line 1: stop must be"),
    "lone surrogate": (b'{"prompt": "\\ud800"}\n', " line 1: a string in it is not valid UTF-8"),
    "prompt too long": (b"short\n" + b"x" * 5000 + b"\n", " line 2: the prompt has"),
    "unknown role": (b'{"prompt": "a"}\n{"messages": [{"role": "usr", "content": "b"}]}\n',
                     " line 2: messages[0].role is 'usr': the chat template takes only the roles"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_prompts_file_is_one_line_before_generation(tmp_path, case):
    content, message = BAD_FILES[case]
    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    code, out, err = run("generate", "--model", "tiny", "--raw", "--prompts-file", str(path), "-n", "4")
    assert code == 1 and out == "" and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"npqwen: error: {path}{message}"), err


@pytest.mark.parametrize("args, message", [
    (["--prompts-file", "/no/such/prompts.txt"], "npqwen: error: /no/such/prompts.txt: cannot read it"),
    (["--prompts-file", "."], "npqwen: error: .: cannot read it"),
    (["--prompts-file", "FILE", "-t", "-1"], "npqwen: error: temperature must be"),   # the command line's: no line
    (["--prompts-file", "FILE", "--max-batch-size", "0"], "npqwen: error: max_batch_size must be"),
    (["--prompts-file", "FILE", "--state-snapshots", "-1"], "npqwen: error: state_snapshots must be"),
    (["--prompts-file", "FILE", "--output", "/no/such/dir/out.jsonl"], "npqwen: error: /no/such/dir/out.jsonl: "),
    (["--prompt", "hi", "--output", "out.jsonl"], "npqwen: error: --output goes with --prompts-file"),
    (["--prompt", "hi", "--max-batch-size", "2"], "npqwen: error: --max-batch-size goes with --prompts-file"),
])
def test_bad_prompts_file_options_are_one_line(tmp_path, args, message):
    path = tmp_path / "prompts.txt"
    path.write_text("hello\n", encoding="utf-8")
    code, out, err = run("generate", "--model", "tiny", *[str(path) if a == "FILE" else a for a in args])
    assert code == 1 and out == "" and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), err


def test_prompt_and_prompts_file_exclude_each_other(tmp_path):
    code, _, err = run("generate", "--model", "tiny", "--prompt", "hi", "--prompts-file", "x.txt")
    assert code == 2 and "not allowed with" in err
    code, _, err = run("generate", "--model", "tiny")
    assert code == 2 and "--prompt/-p --prompts-file is required" in err


def test_peak_memory_is_the_commands_own_not_its_parents():
    """A parent that once held 1.5 GB starts `npqwen generate --model tiny` (fork and exec): the command
    reports its own peak (Linux's VmHWM), not the parent's, which ru_maxrss keeps across exec."""
    if not os.path.isfile("/proc/self/status"):
        pytest.skip("no /proc here (not Linux)")
    parent = ("import subprocess, sys, numpy as np\n"
              "big = np.ones(1_500_000_000 // 8); del big\n"   # touched, then freed: the parent's peak stays
              "r = subprocess.run([sys.executable, '-m', 'npqwen', 'generate', '--model', 'tiny', '-p', 'hi', '-n', '2'],"
              " capture_output=True, text=True)\n"
              "print(r.stderr)\n")
    result = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, cwd=ROOT, timeout=300)
    peak = float(re.search(r"peak memory: ([0-9.]+) GB", result.stdout).group(1))
    print(result.stdout)
    assert 0 < peak < 1.0, peak


def test_chat_help_is_a_command_not_a_message():
    code, out, err = run("chat", "--model", "tiny", "-n", "2", stdin=b"/help\n/exit\n")
    assert code == 0 and "/reset" in err.split("/help lists the commands", 1)[1] and "/exit, /quit" in err
    assert prompt_tokens(err) == [] and "random weights: its text is meaningless" in err   # nothing went to the model


def test_a_piece_made_after_ctrl_c_is_not_shown(monkeypatch, capsys):
    from npqwen.cli.common import stream_to_stdout

    pressed = []

    class Model:   # the second piece is made by the step during which Ctrl-C arrives
        def stream(self, prompt, params, result, **per_request):   # steering=, lora=
            yield "one"
            pressed.append(True)
            yield "two"

    assert stream_to_stdout(Model(), "hi", None, stop_requested=lambda: bool(pressed)) is None
    assert capsys.readouterr().out == "one\n"


@pytest.mark.parametrize("tty", [True, False])
def test_control_characters_are_escaped_on_a_terminal_only(monkeypatch, tty):
    from npqwen.cli.common import write_out

    out = io.StringIO()
    out.isatty = lambda: tty
    monkeypatch.setattr(sys, "stdout", out)
    write_out("a\x1b[2J\tb\x07\r\x9b\x7f\n")
    assert out.getvalue() == ("a\\x1b[2J\tb\\x07\\x0d\\x9b\\x7f\n" if tty else "a\x1b[2J\tb\x07\r\x9b\x7f\n")


def test_steering_mistakes_are_named_by_their_options(tmp_path):
    """A --steer vector, layer or scale the loaded model cannot take: one line naming the option (not the
    request body's steering[0] fields), exit code 1 and no traceback, for generate and chat."""
    import numpy as np

    np.save(tmp_path / "short.npy", np.ones(3, np.float32))
    np.save(tmp_path / "good.npy", np.ones(16, np.float32))
    cases = [(["--steer", tmp_path / "good.npy", "--steer-layer", "7"], "--steer-layer must be a layer from 0 to 1"),
             (["--steer", tmp_path / "short.npy", "--steer-layer", "0"],
              f"--steer {tmp_path / 'short.npy'}: the vector must have 16 values"),
             (["--steer", tmp_path / "good.npy", "--steer-layer", "0", "--steer-scale", "nan"],
              "--steer-scale must be a finite number")]
    for command in (["generate", "-p", "Hi"], ["chat"]):
        for options, message in cases:
            code, out, err = run(*command, "--model", "tiny", "-n", "2", *map(str, options), stdin=b"")
            assert code == 1 and message in err and "Traceback" not in err and "steering[0]" not in err, err
