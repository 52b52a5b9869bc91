"""Qwen3.5's hub layout through the text paths: generate, chat, score, trace names, the CLI (which says the
checkpoint is used for text) and inspect (the layers, the memory, what stays unread). With Qwen3's tokenizer:
there are no Qwen3.5 tokenizer files here."""
import subprocess
import sys

import numpy as np
import pytest

import npqwen

from conftest import ROOT, add_qwen3_tokenizer, needs_qwen3_tokenizer
from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    needs_qwen3_tokenizer()
    path = build_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_text"),
                                   hybrid_config(vocab_size=151936, eos_token_id=151645), hub_layout=True, std=0.1)
    return add_qwen3_tokenizer(path)


def test_generate_chat_and_score(hub_dir):
    llm = npqwen.load(hub_dir)
    out = llm.generate("The capital of France is", max_new_tokens=6, temperature=0)
    assert len(out.token_ids) == 6
    reply = llm.chat([{"role": "user", "content": "hi"}], max_new_tokens=5, temperature=0)
    assert reply is not None
    scored = llm.score("one two three four")
    assert np.isfinite(scored.perplexity)


def test_a_recorder_sees_the_linear_layers_under_hf_names(hub_dir):
    llm = npqwen.load(hub_dir)
    seen = {}
    llm.forward([1, 2, 3], recorder=lambda name, a: seen.setdefault(name, a))
    for name in ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.core_attn_out",
                 "model.layers.0.linear_attn.norm", "model.layers.0.linear_attn.out_proj",
                 "model.layers.3.self_attn.o_proj"):
        assert name in seen, name
    assert "model.language_model.layers.0.linear_attn.A_log" in llm.weights   # the stored names, as on disk


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "npqwen", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_cli_says_it_is_used_for_text(hub_dir):
    result = run_cli("generate", "--model", str(hub_dir), "--prompt", "hi", "-n", "3", "--temperature", "0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Qwen3.5 image-text checkpoint; npqwen uses it for text" in result.stderr


def test_inspect_names_the_linear_layers_and_the_costs(hub_dir):
    result = run_cli("inspect", "--model", str(hub_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    print(result.stdout[:2500])
    for line in ("linear attention           3 layers: [0, 1, 2]", "full attention             1 layers: [3]",
                 "KV cache per token         512 bytes in float32 (full-attention layers only)",
                 "multi-token-prediction head (mtp.*) stay unread on disk",
                 "model.layers.0.linear_attn.in_proj_qkv.weight"):
        assert line in result.stdout, line


def test_the_cli_prefix_cache_keeps_state_snapshots(hub_dir, tmp_path):
    """Prompts sharing a long start, one after another: the third hits the snapshot the second left where
    the shared start ends (docs/linear-attention.md, section 4); --state-snapshots 0 turns that off, and
    the answers are the same either way."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Answer in one short sentence, as plainly as you can: why is the {x} blue?\n"
                               for x in ("sky", "sea", "ice", "jay")))
    runs = {}
    for flags in ((), ("--state-snapshots", "0")):
        result = run_cli("generate", "--model", str(hub_dir), "--prompts-file", str(prompts), "-t", "0", "-n", "4",
                         "--page-size", "4", "--max-batch-size", "1", *flags)
        assert result.returncode == 0, result.stderr[-2000:]
        summary = next(line for line in result.stderr.splitlines() if "from the prefix cache" in line)
        print(flags, summary)
        runs[flags] = (result.stdout, int(summary.split("(")[1].split()[0]))
    (texts, hits), (texts_off, hits_off) = runs[()], runs[("--state-snapshots", "0")]
    assert hits > 0 and hits_off == 0 and texts == texts_off


def test_the_next_turn_of_a_chat_resumes_from_the_last_turns_snapshot(hub_dir):
    """Turn 2's prompt (the chat template over the history) starts with turn 1's prompt, so it resumes from
    the snapshot turn 1 left at its last full page, and answers as an engine without the prefix cache does."""
    from npqwen import Engine

    llm = npqwen.load(hub_dir)
    tokenizer = llm.tokenizer
    system = {"role": "system", "content": "You are a careful assistant who answers in one sentence. " * 4}
    history = [system, {"role": "user", "content": "Why is the sky blue?"}]
    engines = {cache: Engine(llm, kv_cache_tokens=64 * 16, page_size=16, prefix_cache=cache) for cache in (True, False)}
    answers = {True: [], False: []}
    for turn in range(2):
        prompt = tokenizer.apply_chat_template(history)
        for cache, engine in engines.items():
            rid = engine.add_request(prompt, max_new_tokens=6, temperature=0)
            while engine.has_unfinished():
                for o in engine.step():
                    if o.finished and o.request_id == rid:
                        answers[cache].append(o.result.text)
                engine.check()
        history += [{"role": "assistant", "content": answers[True][-1]}, {"role": "user", "content": "And the sea?"}]
    first = len(tokenizer.encode(tokenizer.apply_chat_template(history[:2])))
    hit = engines[True].stats["prefix_cache_hit_tokens"]
    print(f"turn 1: {first} prompt tokens; turn 2 resumed after {hit}")
    assert hit == (first - 1) // 16 * 16 and answers[True] == answers[False]
