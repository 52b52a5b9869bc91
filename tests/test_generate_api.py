"""The Python generation API: stopping, stop strings, streaming, chat reasoning, limits and bad values."""
import numpy as np
import pytest

import npqwen
from npqwen import NpqwenError
from npqwen.llm import LLM, split_reasoning
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
        return logits


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
