"""The Python generation API: stopping, stop strings, streaming, chat reasoning, limits and bad values."""
import re

import numpy as np
import pytest

import npqwen
from npqwen import NpqwenError
from npqwen.llm import LLM, split_reasoning
from npqwen.model import BatchOutput
from npqwen.tiny import IM_END, TINY_GENERATION, tiny_model, tiny_tokenizer


class Scripted:
    """A stand-in model whose logits force a scripted sequence of tokens, to test the loop around it.

    It speaks the engine's packed-batch interface; a sequence's n-th sampled token is script[n]
    (n = its position minus its prompt length), so every generation follows the script from the start.
    """

    def __init__(self, script, config):
        self.script, self.config = list(script), config
        self.xp, self.dtype = np, np.dtype(np.float32)
        self.prompt_lengths = {}   # first page of a sequence -> its prompt length

    def forward_batch(self, batch, kv, recorder=None):
        logits = np.full((len(batch.sample_rows), self.config.vocab_size), -10.0, dtype=np.float32)
        rows = [(r, start, n, table) for (r, n), start, table in zip(batch.rows, batch.starts, batch.page_tables)]
        sampled = 0
        for r, start, n, table in rows:
            if start == 0:
                self.prompt_lengths[int(table[0])] = n   # the whole prompt in one chunk (it is short)
            if r + n - 1 in batch.sample_rows:
                generated = start + n - self.prompt_lengths[int(table[0])]
                logits[sampled, self.script[min(generated, len(self.script) - 1)]] = 10.0
                sampled += 1
        return BatchOutput(logits, hidden=None)


def scripted_llm(text, eos=True):
    tok = tiny_tokenizer()
    script = tok.encode(text) + ([IM_END] if eos else [])
    model = Scripted(script, tiny_model().config)
    model.weights = {}
    return LLM(model, tok, dict(TINY_GENERATION))


@pytest.fixture(scope="module")
def tiny():
    return npqwen.load("tiny")


def test_eos_stops_and_is_returned_but_not_in_the_text():
    llm = scripted_llm("Hello 你好 🎉")
    r = llm.generate("hi", max_new_tokens=100)
    assert r.text == "Hello 你好 🎉" and r.finish_reason == "stop" and r.stop == "<|im_end|>"
    assert r.token_ids[-1] == IM_END and len(r.token_ids) == len(llm.tokenizer.encode("Hello 你好 🎉")) + 1


def test_max_new_tokens_gives_length():
    r = scripted_llm("Hello world").generate("hi", max_new_tokens=3)
    assert (r.text, r.finish_reason, len(r.token_ids)) == ("Hel", "length", 3)


@pytest.mark.parametrize("stop, text, hit", [("###", "Hello", "###"), (["zz", " wor"], "Hello###", " wor"),
                                             ("d", "Hello### worl", "d"), ("lo#", "Hel", "lo#"),
                                             ("not there", "Hello### world", "<|im_end|>")])
def test_stop_strings_are_excluded_and_never_streamed(stop, text, hit):
    llm = scripted_llm("Hello### world")
    pieces = list(llm.stream("hi", stop=stop, max_new_tokens=50))
    r = llm.generate("hi", stop=stop, max_new_tokens=50)
    assert "".join(pieces) == r.text == text
    assert r.finish_reason == "stop" and r.stop == hit


def test_stream_concatenates_to_the_text_with_multibyte_characters():
    llm = scripted_llm("数学 🎉 naïve")
    pieces = list(llm.stream("hi"))
    assert "".join(pieces) == "数学 🎉 naïve"
    assert all("\ufffd" not in p for p in pieces) and len(pieces) < len(llm.tokenizer.encode("数学 🎉 naïve"))


def test_unfinished_character_at_length_limit_is_released():
    llm = scripted_llm("数")   # 3 bytes, 3 tokens
    r = llm.generate("hi", max_new_tokens=2)
    assert r.text == "\ufffd" and "".join(llm.stream("hi", max_new_tokens=2)) == "\ufffd"


def test_chat_separates_reasoning():
    llm = scripted_llm("<think>\nThe user greets me. 你好\n</think>\n\nHello! How can I help?")
    r = llm.chat([{"role": "user", "content": "hi"}])
    assert r.reasoning == "The user greets me. 你好"
    assert r.content == "Hello! How can I help?"
    assert r.messages[-1] == {"role": "assistant", "content": "Hello! How can I help?"}
    assert split_reasoning("no thinking here") == ("", "no thinking here")


def test_chat_prompt_and_thinking_switch(tiny):
    assert tiny.chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.chat_prompt("hi", enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("role, near", [("usr", "user"), ("System", "system"), ("developer", "system"),
                                        ("wizard", None), (None, None)])
def test_a_role_the_template_would_drop_is_refused(tiny, role, near):
    """Qwen3's template writes nothing for another role: the prompt would be just the assistant header."""
    messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for call in (tiny.chat_prompt, lambda m: tiny.chat(m, max_new_tokens=1)):
        with pytest.raises(NpqwenError) as e:
            call(messages)
        message = str(e.value)
        assert message.startswith(f"messages[0].role is {role!r}: ") and "'system', 'user', 'assistant', 'tool'" \
            in message, message
        assert (f"did you mean {near!r}?" in message) == (near is not None), message


def test_seeded_sampling_is_reproducible(tiny):
    a = tiny.generate("Once upon a time", max_new_tokens=20, seed=7, temperature=1.0)
    b = tiny.generate("Once upon a time", max_new_tokens=20, seed=7, temperature=1.0)
    c = tiny.generate("Once upon a time", max_new_tokens=20, seed=8, temperature=1.0)
    assert a.token_ids == b.token_ids and a.text == b.text and a.token_ids != c.token_ids


def test_timings_are_reported(tiny):
    r = tiny.generate("Hello", max_new_tokens=8, temperature=0)
    assert r.prompt_tokens == 5 and len(r.token_ids) == 8 and r.finish_reason == "length"
    assert r.prefill_seconds > 0 and r.decode_seconds > 0
    assert r.prompt_tokens_per_second > 0 and r.generation_tokens_per_second > 0


def test_prompt_that_leaves_no_room(tiny):
    limit = tiny.config.max_position_embeddings
    with pytest.raises(NpqwenError, match=f"{limit} tokens but the context holds {limit}"):
        tiny.generate([65] * limit)
    r = tiny.generate([65] * (limit - 2), max_new_tokens=10, temperature=0)
    assert len(r.token_ids) == 2 and r.finish_reason == "length"   # capped at the context, never past it


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be >= 0"), (dict(top_p=0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(stop=[3]), "stop must be a string"),
    (dict(min_p=-0.1), "min_p"), (dict(repetition_penalty=-1), "repetition_penalty")])
def test_invalid_values_raise_before_generating(tiny, kwargs, message):
    with pytest.raises(NpqwenError, match=message):
        tiny.generate("hi", **kwargs)
    with pytest.raises(NpqwenError, match=message):
        tiny.stream("hi", **kwargs)   # at the call, not at the first token


def test_empty_prompt_and_text_without_tokenizer(tiny):
    with pytest.raises(NpqwenError, match="prompt is empty"):
        tiny.generate("")
    bare = LLM(tiny.model, None, {})
    with pytest.raises(NpqwenError, match="no tokenizer.json"):
        bare.generate("text")
    assert len(bare.generate([1, 2, 3], max_new_tokens=4).token_ids) == 4


def test_forward_takes_any_1d_integer_sequence(tiny):
    want = tiny.forward([1, 2, 3])
    for ids in ((1, 2, 3), range(1, 4), np.array([1, 2, 3], dtype=np.int32), [np.int64(1), np.int16(2), 3],
                np.array([1, 2, 3], dtype=np.uint8)):
        np.testing.assert_array_equal(tiny.forward(ids), want)


@pytest.mark.parametrize("ids, message", [
    (5, "1-D list, tuple, range or integer array, got int"), (np.int64(5), "got int64"),
    ("hi", "encode text first"), (b"hi", "got bytes"), (None, "got NoneType"), ({1: 2}, "got dict"),
    ([[1, 2], [3, 4]], "pass one sequence at a time"), (np.array([[1, 2], [3, 4]]), "1-D array, got shape (2, 2)"),
    ([1.7, 2.2], "1-D sequence of integers, got float 1.7 at index 0"), (np.array([1.7, 2.2]), "dtype float64"),
    ([1, True], "got bool True at index 1"), ([], "empty"), ([1, 10**6], "outside the vocabulary"),
    ([-1], "token id -1 is outside")])
def test_forward_refuses_what_is_not_token_ids(tiny, ids, message):
    with pytest.raises(NpqwenError, match=re.escape(message)) as e:
        tiny.forward(ids)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("prompt, kwargs, message", [
    (b"hi", {}, "decode bytes to str first"), (None, {}, "a prompt is a string"),
    ([1.7, 2.2], {}, "got float 1.7 at index 0"), ([[1, 2], 3], {}, "pass one sequence at a time"),
    (np.array([[1, 2], [3, 4]]), {}, "shape (2, 2)"), (5, {}, "a prompt is a string"),
    ("hi", dict(stop=5), "stop must be a string or a list of strings"), ("hi", dict(stop=[1]), "stop must be"),
    ("hi", dict(max_new_tokens=True), "max_new_tokens"), ("hi", dict(seed=True), "seed"),
    ("hi", dict(temperature=True), "temperature"), ("hi", dict(top_k=np.bool_(True)), "top_k")])
def test_generate_refuses_bad_prompts_and_arguments(tiny, prompt, kwargs, message):
    with pytest.raises(NpqwenError, match=re.escape(message)) as e:
        tiny.generate(prompt, **kwargs)
    assert "\n" not in str(e.value)


def test_prompt_types_and_batches(tiny):
    one = tiny.generate([72, 105], max_new_tokens=4, temperature=0)
    for prompt in ((72, 105), range(72, 106, 33), np.array([72, 105], dtype=np.int32), "Hi"):
        assert tiny.generate(prompt, max_new_tokens=4, temperature=0).token_ids == one.token_ids
    both = tiny.generate([[72, 105], [1, 2]], max_new_tokens=4, temperature=0)   # a list of two prompts
    assert len(both) == 2 and both[0].token_ids == one.token_ids
    assert [r.token_ids for r in tiny.generate(["Hi", "Hi"], max_new_tokens=4, temperature=0)] == [one.token_ids] * 2


def test_numpy_scalars_work_for_every_number(tiny):
    kwargs = dict(temperature=0.5, top_k=5, top_p=0.75, min_p=0.01, repetition_penalty=1.5,
                  presence_penalty=0.5, seed=3, max_new_tokens=6)
    as_numpy = {k: (np.int64(v) if isinstance(v, int) else np.float32(v)) for k, v in kwargs.items()}
    assert tiny.generate("Hi", **as_numpy).token_ids == tiny.generate("Hi", **kwargs).token_ids


def test_tiny_temperature_equals_greedy(tiny):
    greedy = tiny.generate("Once upon a time", max_new_tokens=20, temperature=0)
    for t in (1e-38, np.float32(1e-30)):
        near = tiny.generate("Once upon a time", max_new_tokens=20, temperature=t, seed=1)
        assert near.token_ids == greedy.token_ids


def test_huge_penalties_never_repeat_a_token(tiny):
    r = tiny.generate("Once upon a time", max_new_tokens=30, temperature=0, presence_penalty=1e300)
    assert len(set(r.token_ids)) == len(r.token_ids) == 30
    r = tiny.generate("Once upon a time", max_new_tokens=30, temperature=0.8, repetition_penalty=1e300, seed=0)
    assert len(set(r.token_ids)) == len(r.token_ids) > 20   # it may draw eos (never seen) before 30
    assert not set(r.token_ids) & set(tiny.tokenizer.encode("Once upon a time"))


def test_truncated_thinking_is_reasoning():
    assert split_reasoning("<think>\nLet me think...") == ("Let me think...", "")
    assert split_reasoning("\n<think>\n") == ("", "")
    assert split_reasoning("Answer with <think> in it") == ("", "Answer with <think> in it")
    llm = scripted_llm("<think>\nStill thinking about it", eos=False)
    r = llm.chat("hi", max_new_tokens=8)
    assert r.finish_reason == "length" and r.content == "" and r.reasoning == "Still "   # <think> is one token


def test_chat_reads_reasoning_that_the_template_opened():
    """A template that ends its prompt with "<think>" (later Qwen3 thinking models): the answer starts
    inside the reasoning, so what comes before "</think>" is reasoning (chat_format.split_reasoning)."""
    llm = scripted_llm("I should greet back.\n</think>\n\nHello!")
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n"
    r = llm.chat("hi")
    assert (r.reasoning, r.content) == ("I should greet back.", "Hello!")
    assert llm.chat("hi", enable_thinking=False).content == "I should greet back.\n</think>\n\nHello!"


MEMORY_PROBE = """
import json, resource, sys, time
import npqwen
llm = npqwen.load(sys.argv[1])
start = time.perf_counter()
stream = llm.stream(list(range(1, 40)), max_new_tokens=int(sys.argv[2]), temperature=0)
next(stream)
first = time.perf_counter() - start
for _, _ in zip(range(4), stream):
    pass
stream.close()
print(json.dumps(dict(rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, first=first,
                      pool=llm.engine.pool.num_pages * llm.engine.page_size)))
"""


def test_a_huge_max_new_tokens_costs_nothing_until_used(tmp_path):
    """The KV pool is np.zeros (untouched pages cost no RAM) and pages are taken as tokens come,
    so max_new_tokens=10**9 on a 131072-position model costs what max_new_tokens=5 does."""
    import json
    import subprocess
    import sys

    from conftest import write_npqwen_checkpoint
    from npqwen.tiny import TINY_CONFIG

    path = write_npqwen_checkpoint(tmp_path / "long", {**TINY_CONFIG, "max_position_embeddings": 131072})
    tiny_tokenizer().save(path)
    runs = {}
    for n in (5, 10**9):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path), str(n)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        runs[n] = json.loads(out.stdout)
    print(runs)
    small, huge = runs[5], runs[10**9]
    pool_bytes = huge["pool"] * 2 * 2 * 2 * 8 * 4    # layers * (k, v) * kv heads * head_dim * float32
    assert huge["pool"] >= 131072 and pool_bytes > 20 * 2**20   # a pool that would show if it were touched
    assert huge["rss"] < small["rss"] + 20 * 2**20
    assert huge["first"] < small["first"] + 1.0


def test_a_max_new_tokens_past_the_pool_runs_and_holds_the_pages_of_what_came(tiny):
    """Pages are taken as tokens come (vLLM admits by the prompt and grows): max_new_tokens=10**9 on a pool
    of 4 pages of 16, far below the context (4096), streams, holding only the pages of the tokens so far;
    run alone to the end it stops with "length" where the pool is full, never preempting itself in a loop."""
    from npqwen.engine import Engine

    llm = LLM(tiny.model, tiny.tokenizer, {**TINY_GENERATION, "eos_token_id": [1]})   # an eos the model never says
    engine = llm._engine = Engine(llm, kv_cache_tokens=64, page_size=16)
    prompt = llm.tokenizer.encode("Hi there")
    stream = llm.stream(prompt, max_new_tokens=10**9, temperature=0)
    for _, _ in zip(range(3), stream):
        (req,) = engine.requests.values()
        held = len(req.page_table)
        assert held == -(-req.cached_len // 16) <= 1, (held, req.cached_len)   # its own tokens' pages, no more
        engine.check()
    stream.close()
    r = llm.generate(prompt, max_new_tokens=10**9, temperature=0)
    print(f"alone: {len(r.token_ids)} tokens, finish_reason {r.finish_reason}, "
          f"{engine.stats['preemptions']} preemptions")
    assert (r.finish_reason, len(r.token_ids), engine.stats["preemptions"]) == ("length", 64 - len(prompt), 0)
    assert 1 not in r.token_ids and not engine.has_unfinished()
    engine.check()
    with pytest.raises(NpqwenError, match=r"a prompt of 64 tokens needs 5 KV pages of 16 positions .* the pool has "
                                          r"4 \(64 positions\)"):
        llm.stream([65] * 64, max_new_tokens=1)
