"""`npqwen perplexity --model M --input FILE`: the model's perplexity on a text file, in one window
or overlapping ones, equal to HF transformers' on the same checkpoint; the mistakes it refuses."""
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from npqwen.tiny import ENDOFTEXT, IM_END, tiny_tokenizer

from conftest import build_hf_checkpoint, hf_model, tiny_config
from npqwen import Qwen3Config
from tolerance import logprob_tolerance

TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 6   # 408 byte tokens


def run(*args, stdin: str | None = None):
    out = subprocess.run([sys.executable, "-m", "npqwen", "perplexity", *args], input=stdin, capture_output=True,
                         text=True, timeout=120)
    return out.returncode, out.stdout, out.stderr


def printed_perplexity(out: str) -> float:
    return float(re.match(r"perplexity (\S+) ", out).group(1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    path = build_hf_checkpoint(tmp_path_factory.mktemp("perplexity"), tiny_config(eos_token_id=IM_END,
                                                                                   bos_token_id=ENDOFTEXT), std=0.1)
    tiny_tokenizer().save(path)
    return path


def hf_perplexity(path, ids: list[int], window: int, stride: int) -> float:
    """Hugging Face's sliding-window recipe, by hand: each window scores the tokens no window before it did."""
    import torch

    model, logprobs, scored_to = hf_model(path), [], 1
    for start in range(0, len(ids), stride):
        end = min(start + window, len(ids))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[start:end]])).logits[0].double(), dim=-1)
        logprobs += [float(logp[j - 1 - start, ids[j]]) for j in range(scored_to, end)]
        scored_to = end
        if end == len(ids):
            break
    assert len(logprobs) == len(ids) - 1
    return math.exp(-np.mean(logprobs))


@pytest.mark.parametrize("window, stride", [(None, None), (200, 64), (100, 99)])
def test_perplexity_equals_hf(checkpoint, tmp_path, window, stride):
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    sizes = [*(["--window", str(window)] if window else []), *(["--stride", str(stride)] if stride else [])]
    code, out, err = run("--model", str(checkpoint), "--input", str(text_file), *sizes)
    assert code == 0, err
    ids = tiny_tokenizer().encode(TEXT)
    want = hf_perplexity(checkpoint, ids, window or 2048, stride or (window or 2048) // 2)
    got = printed_perplexity(out)
    print(f"window {window}, stride {stride}: npqwen {got:.4f}, HF transformers {want:.4f}")
    # exp(-mean log p): relative to it, the log-probabilities' float32 bar (logits at most 8 on this checkpoint),
    # then printed to 4 decimals
    bound = logprob_tolerance(Qwen3Config.from_dict(tiny_config()), window or len(ids), 8.0) * want + 5e-5
    assert abs(got - want) <= bound, (got, want, bound)
    assert f"over {len(ids) - 1} tokens" in out and "tokens/s" in err


@pytest.mark.parametrize("text, count", [("ab", "1 token"), (TEXT, "407 tokens")])
def test_perplexity_says_one_count(text, count):
    code, out, err = run("--model", "tiny", "--input", "-", "--window", "100", stdin=text)
    assert code == 0 and f"over {count} of stdin" in out and f"scored {count} in" in err, (out, err)


def test_perplexity_reads_stdin():
    code, out, err = run("--model", "tiny", "--input", "-", stdin=TEXT)
    assert code == 0 and "of stdin" in out, err


@pytest.mark.parametrize("content, args, words", [
    (b"", [], "has 0 tokens"),
    (b"x", [], "has 1 token:"),
    (b"caf\xe9", [], "line 1: not valid UTF-8"),
    (b"text", ["--window", "1"], "--window must be at least 2"),
    (b"text", ["--window", "8", "--stride", "8"], "--stride 8 must be less than the window"),
    (b"text", ["--window", "5000"], "more than the model's context"),
])
def test_perplexity_mistakes_are_one_line(tmp_path, content, args, words):
    path = tmp_path / "in.txt"
    path.write_bytes(content)
    code, out, err = run("--model", "tiny", "--input", str(path), *args)
    assert code == 1 and err.count("npqwen: error:") == 1 and words in err and "Traceback" not in err, err


def test_perplexity_of_a_missing_file(tmp_path):
    code, _, err = run("--model", "tiny", "--input", str(tmp_path / "nope.txt"))
    assert code == 1 and "cannot read it" in err and "Traceback" not in err, err
