"""lm-evaluation-harness against `npqwen serve`: a real `lm_eval --model local-completions` run of a
small multiple-choice task from a local JSONL file (no hub), whose per-choice loglikelihoods equal
HF transformers' on the same random-weight checkpoint; the same numbers from llm.score; and the
echo / prompt_logprobs answers they rest on."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity", reason="lm_eval's API models need tenacity (pip install 'lm_eval[api]')")
torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

import npqwen  # noqa: E402
from npqwen.tiny import IM_END, ENDOFTEXT, tiny_tokenizer  # noqa: E402

from conftest import build_hf_checkpoint, hf_model, tiny_config  # noqa: E402
from tolerance import logprob_tolerance  # noqa: E402
from serving import http_json  # noqa: E402
from test_server_cli import start, stop  # noqa: E402

TOLERANCE = 1e-3   # the bar on a summed log-likelihood (lm-eval's); float32 on both sides agrees to ~1e-5
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
    {"question": "Water boils at", "choices": ["100 degrees", "ten degrees", "the café, où l'eau bout"], "answer": 0},
]
TASK = """task: npqwen_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random-weight checkpoint written by transformers, with the tiny byte-level tokenizer."""
    path = build_hf_checkpoint(tmp_path_factory.mktemp("eval-checkpoint"),
                               tiny_config(eos_token_id=IM_END, bos_token_id=ENDOFTEXT), std=0.1)
    tiny_tokenizer().save(path)
    return path


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) by HF transformers, float32."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)   # (T, V)
    n = len(context)
    return float(sum(logp[n - 1 + i, t] for i, t in enumerate(continuation)))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's TemplateLM._encode_pair: context's trailing spaces move to the continuation, the
    whole is encoded, and the continuation is what follows the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, context_ids = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def test_lm_eval_multiple_choice_equals_hf(checkpoint, tmp_path, capsys):
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "npqwen_mc.yaml").write_text(TASK.format(data=data))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    proc, url = start("--model", str(checkpoint), "--log-level", "warning")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"model={checkpoint},base_url={url}/v1/completions,num_concurrent=1,max_retries=1",
             "--tasks", "npqwen_mc", "--include_path", str(tmp_path / "tasks"), "--output_path",
             str(tmp_path / "out"), "--log_samples"], capture_output=True, text=True, env=env, cwd=tmp_path,
            timeout=300)
    finally:
        code, err = stop(proc)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Auto-detected remote tokenizer support" in run.stderr, "lm_eval did not use the server's tokenizer"
    assert code == 0 and "Traceback" not in err, err[-2000:]
    (samples,) = (tmp_path / "out").rglob("samples_npqwen_mc_*.jsonl")
    records = [json.loads(line) for line in samples.read_text().splitlines()]

    llm, hf = npqwen.load(checkpoint), hf_model(checkpoint)
    rows, worst = [], 0.0
    for record in sorted(records, key=lambda r: r["doc_id"]):
        for i, resp in enumerate(record["filtered_resps"]):
            args = record["arguments"][f"gen_args_{i}"]
            context, continuation = encode_pair(llm.tokenizer, args["arg_0"], args["arg_1"])
            got, want = float(resp[0]), hf_loglikelihood(hf, context, continuation)
            score = llm.score(context + continuation).logprobs[len(context) - 1:]
            assert len(score) == len(continuation)
            worst = max(worst, abs(got - want), abs(sum(score) - want))
            rows.append((record["doc_id"], args["arg_1"], got, want, sum(score)))
    with capsys.disabled():
        print("\nlm_eval local-completions against npqwen serve; loglikelihood of each choice:")
        print(f"{'doc':>3}  {'choice':<26} {'lm_eval (npqwen)':>18} {'HF transformers':>18} {'llm.score':>18}")
        for doc, choice, got, want, score in rows:
            print(f"{doc:>3}  {choice!r:<26} {got:18.6f} {want:18.6f} {score:18.6f}")
        print(f"max |difference| {worst:.2e}")
    assert len(rows) == sum(len(d["choices"]) for d in DOCS)
    assert worst < TOLERANCE, rows


def test_echo_and_prompt_logprobs_equal_a_forward_pass(checkpoint):
    """What lm_eval reads, checked position by position: echo with max_tokens 1 and 0, logprobs
    with the alternatives, text offsets, vLLM's prompt_logprobs, streamed and not."""
    llm = npqwen.load(checkpoint)
    ids = llm.tokenizer.encode("Scored text, é and more: " * 15)                      # 405 tokens: 4 chunks
    logits = np.asarray(llm.forward(ids), np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    want = logp[np.arange(len(ids) - 1), ids[1:]]                                      # (T - 1,)
    proc, url = start("--model", str(checkpoint), "--log-level", "warning", "--max-batched-tokens", "128")
    try:
        body = {"model": str(checkpoint), "prompt": [ids], "max_tokens": 1, "logprobs": 2, "echo": True,
                "temperature": 0, "prompt_logprobs": 3}
        status, out = http_json("POST", url + "/v1/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(llm.tokenizer.decode(ids)) and len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        diff = np.abs(np.array(lp["token_logprobs"][1:len(ids)]) - want).max()
        bound = logprob_tolerance(llm.config, len(ids), logits)   # the server's chunks of 128 against one pass
        assert diff <= bound, f"prompt logprobs differ from a forward pass by {diff} (tolerance {bound:.1e})"
        for j in (1, 200, len(ids) - 1):   # the alternatives: the 2 most likely, and the prompt token itself
            best = np.argsort(-logp[j - 1])[:2]
            top = lp["top_logprobs"][j]
            assert np.allclose(sorted(top.values(), reverse=True)[:2], logp[j - 1][best], rtol=0, atol=bound), top
            assert any(abs(v - want[j - 1]) <= bound for v in top.values())
        text = choice["text"]
        for j, offset in enumerate(lp["text_offset"][:len(ids)]):
            assert llm.tokenizer.decode(ids[:j]).rstrip("\ufffd") == text[:offset], j
        vllm = choice["prompt_logprobs"]
        assert vllm[0] is None and len(vllm) == len(ids)
        for j in (1, 300):
            entry = vllm[j][str(ids[j])]
            assert abs(entry["logprob"] - want[j - 1]) <= bound
            assert entry["rank"] == 1 + int((logp[j - 1] > logp[j - 1][ids[j]]).sum())
        assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 1
        # max_tokens 0: the prompt alone; streamed: the prompt first, then the answer
        status, alone = http_json("POST", url + "/v1/completions", {**body, "max_tokens": 0, "prompt_logprobs": None})
        assert alone["choices"][0]["text"] == llm.tokenizer.decode(ids) and alone["usage"]["completion_tokens"] == 0
        assert alone["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
        stream = [json.loads(line[6:]) for line in http_stream(url, {**body, "stream": True, "max_tokens": 4})]
        assert "".join(c["choices"][0]["text"] for c in stream).startswith(llm.tokenizer.decode(ids))
        streamed = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in stream), [])
        assert streamed[:len(ids)] == lp["token_logprobs"][:len(ids)] and len(streamed) == len(ids) + 4
    finally:
        code, err = stop(proc)
    assert code == 0 and "Traceback" not in err, err[-2000:]


def http_stream(url: str, body: dict) -> list[str]:
    import urllib.request

    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().split("\n\n")
    return [line for line in lines if line.startswith("data: {")]


def test_llm_score_equals_hf_and_says_what_it_returns(checkpoint):
    llm, hf = npqwen.load(checkpoint), hf_model(checkpoint)
    texts = ["The capital of France is Paris.", "A", "Two plus two equals four, " * 15]
    scores = llm.score(texts)
    for text, s in zip(texts, scores):
        ids = llm.tokenizer.encode(text)
        assert s.token_ids == ids and len(s.logprobs) == len(ids) - 1
        if len(ids) > 1:
            want = hf_loglikelihood(hf, ids[:1], ids[1:])
            assert abs(s.total - want) < TOLERANCE, (text, s.total, want)
            # exp(-total / (T - 1)): the total's bar over T - 1 in the log
            assert abs(np.log(s.perplexity) + want / (len(ids) - 1)) < TOLERANCE / (len(ids) - 1)
    assert np.isnan(scores[1].perplexity) and scores[1].logprobs == []        # one token: nothing to score
    single = llm.score(texts[0])   # alone, not in a batch of three: float32 rounding apart, the same
    logits = llm.forward(single.token_ids)
    assert single.token_ids == scores[0].token_ids and np.allclose(
        single.logprobs, scores[0].logprobs, rtol=0, atol=logprob_tolerance(llm.config, len(single.token_ids), logits))
    with pytest.raises(npqwen.NpqwenError, match="outside the vocabulary"):
        llm.score([1, 2, 99999])
