"""`npqwen generate` and `chat` with --json-schema, --regex, --choice, --grammar, and the JSONL fields of
--prompts-file, run for real on the tiny model's random weights at temperature 1."""
import json
import re

import pytest

pytest.importorskip("llguidance")

from test_cli import run  # noqa: E402
from test_structured import ARITHMETIC, ARITHMETIC_GBNF, SCHEMAS, arithmetic, valid_json  # noqa: E402

SCHEMA = SCHEMAS["nested objects"]


def test_generate_with_each_kind_of_constraint(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for source in (str(schema_file), json.dumps(SCHEMA)):       # a file, or the schema's JSON text
        code, out, err = run("generate", "-m", "tiny", "-p", "A user:", "--no-think", "-t", "1", "--seed", "3",
                             "--json-schema", source)
        assert code == 0 and "(stop)" in err
        valid_json(out.removesuffix("\n"), SCHEMA)
    code, out, _ = run("generate", "-m", "tiny", "-p", "x", "--raw", "-t", "1", "--seed", "4",
                       "--regex", "[a-z]{2,6}-[0-9]{2}")
    assert code == 0 and re.fullmatch("[a-z]{2,6}-[0-9]{2}", out.removesuffix("\n"))
    code, out, _ = run("generate", "-m", "tiny", "-p", "x", "--no-think", "-t", "1", "--seed", "5",
                       "--choice", "north", "--choice", "south")
    assert code == 0 and out in ("north\n", "south\n")
    for name, text in (("arith.lark", ARITHMETIC), ("arith.gbnf", ARITHMETIC_GBNF)):
        (tmp_path / name).write_text(text)
        code, out, _ = run("generate", "-m", "tiny", "-p", "x", "--raw", "-t", "1", "--seed", "6",
                           "--grammar", str(tmp_path / name))
        assert code == 0 and arithmetic(out.removesuffix("\n")), out


def test_prompts_file_lines_carry_their_own_constraint(tmp_path):
    lines = [{"prompt": "plain"},                                             # the command line's --regex
             {"prompt": "json", "json_schema": SCHEMA},
             {"prompt": "json text", "json_schema": json.dumps(SCHEMA), "seed": 2},
             {"prompt": "re", "regex": "[A-Z]{3}"},
             {"prompt": "pick", "choice": ["red", "blue"]},
             {"messages": [{"role": "user", "content": "sum"}], "grammar": ARITHMETIC}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code, out, err = run("generate", "-m", "tiny", "--prompts-file", str(path), "--no-think", "-t", "1",
                         "--seed", "1", "-n", "300", "--regex", "[0-9]{4}")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["finish_reason"] for r in records] == ["stop"] * 6
    texts = [r["text"] for r in records]
    assert re.fullmatch("[0-9]{4}", texts[0]) and re.fullmatch("[A-Z]{3}", texts[3])
    valid_json(texts[1], SCHEMA)
    valid_json(texts[2], SCHEMA)
    assert texts[4] in ("red", "blue") and arithmetic(texts[5])


def test_chat_constrains_every_answer():
    code, out, err = run("chat", "-m", "tiny", "--no-think", "-t", "1", "--seed", "2", "--choice", "yes",
                         "--choice", "no", stdin=b"Is it?\nAnd now?\n")
    assert code == 0 and "Traceback" not in err
    assert out.count(">>> ") == 3 and all(a in ("yes", "no") for a in out.replace(">>> ", "").split())


@pytest.mark.parametrize("args, message", [
    (["--regex", "(a"], "the regex constraint cannot be used: .*unclosed group"),
    (["--json-schema", "missing.json"], "--json-schema missing.json: no such file"),
    (["--json-schema", '{"type": "strin"}'], "Invalid type: strin"),
    (["--json-schema", "{broken"], "--json-schema: json_schema is not valid JSON"),
    (["--choice", ""], r"--choice: choice\[0\] must be a non-empty string"),
])
def test_bad_constraints_are_one_line(args, message):
    code, _, err = run("generate", "-m", "tiny", "-p", "x", "--no-think", *args)
    assert code == 1 and "Traceback" not in err and re.search(message, err), err


def test_a_bad_constraint_in_a_prompts_file_names_its_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "json_schema": {"type": "strin"}}\n')
    code, _, err = run("generate", "-m", "tiny", "--prompts-file", str(path))
    assert code == 1 and f"{path} line 2: the json_schema constraint cannot be used: Invalid type" in err


def test_a_prompts_file_record_of_a_failed_constraint_says_what_failed():
    """A request whose constraint failed while it ran (Engine._fail) is written with its error, the rest as usual."""
    from npqwen.cli.generate import FilePrompt, result_record
    from npqwen.generate import GenerationResult

    failed = GenerationResult("{\"a\"", [1, 2], "error", 4, error="the json_schema constraint failed: ...")
    record = result_record(0, FilePrompt(1, prompt="json"), failed)
    assert record["finish_reason"] == "error" and record["error"].startswith("the json_schema constraint failed")
    assert "error" not in result_record(1, FilePrompt(2, prompt="x"), GenerationResult("ok", [3], "stop", 1))
