"""`npqwen embed` and `npqwen rerank`, run for real in a subprocess: their output equals llm.embed and
llm.rerank, and every mistake the command line can make is one error line."""
import json

import numpy as np
import pytest

import npqwen

from test_cli import run
from tolerance import logprob_tolerance

pytest.importorskip("sentence_transformers")

TEXTS = ["The capital of China is Beijing.", "Gravity is a force.", "北京 🙂"]


def test_embed_writes_npy_and_jsonl_equal_to_llm_embed(embedding_small, tmp_path):
    llm = npqwen.load(embedding_small)
    code, out, err = run("embed", "-m", embedding_small, *[a for t in TEXTS for a in ("--text", t)],
                         "-o", tmp_path / "out.npy")
    assert code == 0 and out == "" and "wrote 3 embeddings" in err and "3 done" in err and "texts/s" in err
    # the command runs llm.embed's requests in the same batches, and .npy and JSON carry each float32 exactly
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), llm.embed(TEXTS))
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS + ["a\nb"]))
    code, out, err = run("embed", "-m", embedding_small, "--input", tmp_path / "texts.jsonl",
                         "--instruction", "Find it", "--dimensions", "8")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["index"] for r in rows] == [0, 1, 2, 3] and rows[3]["text"] == "a\nb"
    np.testing.assert_array_equal(np.float32([r["embedding"] for r in rows]),
                                  llm.embed(TEXTS + ["a\nb"], instruction="Find it", dimensions=8))
    (tmp_path / "lines.txt").write_text("one line\n\nanother line\n")
    code, out, err = run("embed", "-m", embedding_small, "-i", "-", "--no-normalize", "-o", tmp_path / "o.jsonl",
                         stdin=(tmp_path / "lines.txt").read_bytes())
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert code == 0 and [r["text"] for r in rows] == ["one line", "another line"]
    np.testing.assert_array_equal(np.float32([r["embedding"] for r in rows]),
                                  llm.embed(["one line", "another line"], normalize=False))


def test_rerank_prints_the_documents_best_first(reranker_small, tmp_path):
    llm, query = npqwen.load(reranker_small), "What is the capital of China?"
    scores = llm.rerank(query, TEXTS)
    code, out, err = run("rerank", "-m", reranker_small, "-q", query, *[a for t in TEXTS for a in ("-d", t)],
                         "--top-n", "2")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["index"] for r in rows] == np.argsort(-scores)[:2].tolist()
    # the command's engine batches the documents otherwise than llm.rerank's: a sigmoid (slope <= 1/4) of logits
    # (at most 8; measured: 5) within their float32 bar
    bound = logprob_tolerance(llm.config, 64, 8.0) / 4
    np.testing.assert_allclose([r["relevance_score"] for r in rows], np.sort(scores)[::-1][:2], rtol=0, atol=bound)
    assert rows[0]["document"] == TEXTS[rows[0]["index"]] and "prompt tokens" in err


@pytest.mark.parametrize("args, message", [
    (["embed", "--text", "a", "-o", "out.csv"], "--output must end in .npy"),
    (["embed", "--text", "a", "-o", "/no/such/dir/out.npy"], "no such directory"),
    (["embed", "--text", "a", "--dimensions", "0"], "--dimensions must be at least 1"),
    (["embed", "--input", "/no/such/file"], "cannot read it"),
    (["rerank", "-q", "q", "-d", "d", "--top-n", "0"], "--top-n must be at least 1"),
])
def test_command_line_mistakes_before_the_load(args, message):
    code, out, err = run(*args, "-m", "/no/such/model")   # the model is never looked at
    assert code == 1 and err.startswith("npqwen: error: ") and len(err.strip().splitlines()) == 1 and message in err


def test_mistakes_after_the_load_are_one_line(embedding_small, tmp_path):
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    for args, message in [(["--text", "a", "--dimensions", "65"], "from 1 to 64"),
                          (["--text", "a", "--prompt-name", "passage"], "'passage' is not one of"),
                          (["--input", tmp_path / "blank.txt"], "no texts"),
                          (["--input", tmp_path / "bad.jsonl"], "line 2: a JSONL line is")]:
        code, out, err = run("embed", "-m", embedding_small, *args)
        assert code == 1 and message in err and "Traceback" not in err, err
    code, out, err = run("rerank", "-m", "tiny", "-q", "q", "-d", "d")
    assert code == 1 and 'no "yes" and "no" tokens' in err


def test_inspect_reads_a_qwen3model_checkpoint(embedding_small):
    code, out, err = run("inspect", "-m", embedding_small)
    assert code == 0 and "MISSING" not in out and "model.layers.2.mlp.down_proj.weight" in out and "[151669, 64]" in out


@pytest.mark.parametrize("args", [["embed", "-m", "tiny-embedding", "--text", "hi"],
                                  ["rerank", "-m", "tiny-reranker", "-q", "q", "-d", "a", "-d", "b"],
                                  ["embed", "-m", "tiny-reranker", "--text", "hi"],
                                  ["inspect", "-m", "tiny-embedding"], ["inspect", "-m", "tiny-reranker"]])
def test_the_tiny_twins_run_offline(args):
    code, out, err = run(*args, env={"HF_HUB_OFFLINE": "1"})
    assert code == 0 and out and "Traceback" not in err, err
