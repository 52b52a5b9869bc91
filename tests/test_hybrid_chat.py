"""Qwen3.5's thinking format on a hybrid checkpoint whose tokenizer_config.json carries a Qwen3.5-style chat
template: its generation prompt opens the reasoning ("<|im_start|>assistant\\n<think>\\n"), or with thinking off
closes an empty block ("<think>\\n\\n</think>\\n\\n"), so the answer starts inside the reasoning. llm.chat,
the server's reasoning_content (whole and streamed; Messages' thinking block) and `npqwen chat` split it; the
prompt equals transformers'. With Qwen3's tokenizer files (there are no Qwen3.5 ones here) and a model whose
answers are scripted."""
import json
import re
import subprocess
import sys

import pytest

import npqwen
from npqwen import Engine

from conftest import ROOT, add_qwen3_tokenizer, needs_qwen3_tokenizer
from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_config
from serving import LiveServer, ScriptedModel, http_json

pytest.importorskip("transformers")

# Qwen3's generation prompt leaves "<think>" to the model; Qwen3.5's writes it (and closes it when thinking is off)
QWEN3_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3_5_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""
OPENED, CLOSED = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
SCRIPT = {   # what the model writes after "<|im_start|>assistant\n" (the template's part first)
    "Q-ON": "<think>\nThe state is a matrix of dk x dv.\n</think>\n\nIt does not grow.",
    "Q-OFF": "<think>\n\n</think>\n\nIt does not grow.",
}


def qwen3_5_template(path):
    """Qwen3's chat template from tokenizer_config.json with Qwen3.5's generation prompt."""
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    assert template.rstrip().endswith(QWEN3_GENERATION_PROMPT), template[-400:]
    return template.rstrip().removesuffix(QWEN3_GENERATION_PROMPT) + QWEN3_5_GENERATION_PROMPT


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    needs_qwen3_tokenizer()
    path = add_qwen3_tokenizer(build_hybrid_checkpoint(tmp_path_factory.mktemp("qwen3_5_chat"),
                                                       hybrid_config(vocab_size=151936, eos_token_id=151645), std=0.1))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = qwen3_5_template(path)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def scripted(path):
    llm = npqwen.load(path)
    llm.model = ScriptedModel(llm.model, llm.tokenizer, SCRIPT, eos_id=llm.eos_token_ids[0])
    return llm


HISTORY = [{"role": "user", "content": "Q-ON: does the state grow?"},
           {"role": "assistant", "content": "No.", "reasoning_content": "It is a fixed matrix."},
           {"role": "user", "content": "Q-ON: why not?"}]


@pytest.mark.parametrize("thinking", [True, False])
def test_the_prompt_equals_transformers(qwen3_5_dir, thinking):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3_5_dir)
    llm = npqwen.load(qwen3_5_dir)
    for messages in (HISTORY[:1], HISTORY):
        ours = llm.chat_prompt(messages, enable_thinking=thinking)
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert ours == want, (ours[-200:], want[-200:])
        assert ours.endswith(OPENED if thinking else CLOSED)


def test_a_chat_template_jinja_file_is_read_too(qwen3_5_dir, tmp_path):
    """Checkpoints may ship the template as chat_template.jinja beside a tokenizer_config.json without one."""
    import shutil

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(qwen3_5_dir / name, tmp_path / name)
    config = json.loads((qwen3_5_dir / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(config.pop("chat_template"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert npqwen.load(tmp_path).chat_prompt("hi").endswith(OPENED)


def test_llm_chat_splits_reasoning_the_template_opened(qwen3_5_dir):
    llm = scripted(qwen3_5_dir)
    r = llm.chat("Q-ON: does the state grow?", max_new_tokens=80)
    print(repr(r.text))
    assert (r.reasoning, r.content) == ("The state is a matrix of dk x dv.", "It does not grow.")
    assert not r.text.startswith("<think>")   # the prompt wrote it
    r = llm.chat("Q-OFF: does the state grow?", enable_thinking=False, max_new_tokens=80)
    assert (r.reasoning, r.content, r.text) == ("", "It does not grow.", "It does not grow.")


def test_the_server_splits_reasoning_the_template_opened(qwen3_5_dir):
    llm = scripted(qwen3_5_dir)
    server = LiveServer(llm, engine=Engine(llm, kv_cache_tokens=2048, page_size=16, prefix_cache=False))
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Q-ON: does the state grow?"}]
        whole = client.chat.completions.create(model="test-model", messages=messages, max_tokens=80).choices[0]
        assert (whole.message.reasoning_content, whole.message.content) == \
            ("The state is a matrix of dk x dv.", "It does not grow.")
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(model="test-model", messages=messages, max_tokens=80,
                                                    stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
            content += (delta.content or "") if delta else ""
        assert (reasoning, content) == ("The state is a matrix of dk x dv.", "It does not grow.")
        off = client.chat.completions.create(model="test-model", max_tokens=80,
                                             messages=[{"role": "user", "content": "Q-OFF: does it grow?"}],
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert (getattr(off.choices[0].message, "reasoning_content", None), off.choices[0].message.content) == \
            (None, "It does not grow.")
        status, message = http_json("POST", server.url + "/v1/messages", {   # Anthropic's Messages, run as a chat
            "model": "test-model", "max_tokens": 80, "thinking": {"type": "enabled", "budget_tokens": 40},
            "messages": [{"role": "user", "content": "Q-ON: does the state grow?"}]})
        assert status == 200, message
        assert [(b["type"], b.get("thinking", b.get("text"))) for b in message["content"]] == \
            [("thinking", "The state is a matrix of dk x dv."), ("text", "It does not grow.")]
        server.wait_idle()
        assert [e.getMessage() for e in server.errors] == []
    finally:
        server.close()


def test_npqwen_chat_shows_the_opened_tag_and_keeps_only_the_answer(qwen3_5_dir):
    """The random model's greedy answers: the terminal shows the "<think>" the template wrote before them, and
    the second turn's prompt holds the first answer without its reasoning (here all of it: no "</think>")."""
    result = subprocess.run([sys.executable, "-m", "npqwen", "chat", "--model", str(qwen3_5_dir), "-n", "5", "-t", "0"],
                            input="first question\nsecond question\n", capture_output=True, text=True, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    first_answer = result.stdout.split(">>> ")[1]
    assert first_answer.startswith("<think>\n"), repr(result.stdout[:300])
    llm = npqwen.load(qwen3_5_dir)
    first = [{"role": "user", "content": "first question"}]
    text = llm.generate(llm.chat_prompt(first), max_new_tokens=5, temperature=0).text
    assert first_answer == "<think>\n" + text + "\n"
    from npqwen.chat_format import split_reasoning

    content = split_reasoning(text, True, opened=True)[1]
    second = first + [{"role": "assistant", "content": content}, {"role": "user", "content": "second question"}]
    counts = [int(n) for n in re.findall(r"prompt: (\d+) tokens", result.stderr)]
    assert counts == [len(llm.tokenizer.encode(llm.chat_prompt(m))) for m in (first, second)], counts


def test_a_thinking_budget_counts_from_the_opened_tag(qwen3_5_dir):
    """The random model reasons from the prompt's "<think>"; after 3 tokens the engine writes the close for it."""
    from npqwen.engine.thinking import FORCED_CLOSE

    llm = npqwen.load(qwen3_5_dir)
    r = llm.chat("Does the state grow?", max_new_tokens=12, temperature=0, thinking_budget=3)
    close = llm.tokenizer.encode(FORCED_CLOSE)
    print(repr(r.text), r.token_ids)
    assert r.token_ids[3:3 + len(close)] == close
    assert r.reasoning == llm.tokenizer.decode(r.token_ids[:3]).strip("\n") and r.content
