"""The real Qwen3 tokenizer files: encode/decode and the chat template equal HF's; streaming never splits UTF-8."""
import pytest

from npqwen import NpqwenError
from npqwen.tokenizer import Tokenizer

from conftest import QWEN3_TOKENIZER_DIR, needs_qwen3_tokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm -- isn't it?",
    "chinese": "你好，世界！今天天气怎么样？我们去公园散步吧。𠜎𠜱𡃁 龘靐齉",
    "emoji": "Great job! 🎉🤖👨‍👩‍👧‍👦 🫠🪿 ❤️‍🔥 👍🏽",
    "code": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
            "print([fib(i) for i in range(10)])  # {\"a\": 1}\r\n\ttabs\u00a0nbsp",
    "special": "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>",
    "mixed": "naïve café Ελληνικά русский 日本語のテキスト 한국어 العربية ✓ ∑ ∞",
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}

CONVERSATIONS = {
    "single-turn": [{"role": "user", "content": "What is 2 + 2?"}],
    "system+user": [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Name a prime number."}],
    "multi-turn-with-reasoning": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n2 + 2 = 4."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "12.", "reasoning_content": "4 * 3 = 12"},
        {"role": "user", "content": "Thanks! 谢谢"}],
    "tools": [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "<think>\nI should call the tool twice.\n</think>\n\nLet me check.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Tokyo\"}"}}]},
        {"role": "tool", "content": "{\"temp\": 18, \"unit\": \"celsius\"}"},
        {"role": "tool", "content": "{\"temp\": 22, \"unit\": \"celsius\"}"},
        {"role": "assistant", "content": "Paris is 18°C and Tokyo 22°C."},
        {"role": "user", "content": "<tool_response>\nnot really a tool\n</tool_response>"}],
}


@pytest.fixture(scope="module")
def tokenizers():
    needs_qwen3_tokenizer()
    transformers = pytest.importorskip("transformers")
    return Tokenizer.from_dir(QWEN3_TOKENIZER_DIR), transformers.AutoTokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)


@pytest.mark.parametrize("name", TEXTS)
def test_encode_decode_equal_hf(tokenizers, name):
    ours, hf = tokenizers
    text = TEXTS[name]
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"] == hf.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == text


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_hf(tokenizers, name, enable_thinking, add_generation_prompt):
    ours, hf = tokenizers
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "tools" else None
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                   enable_thinking=enable_thinking, tools=tools)
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                  enable_thinking=enable_thinking)
    if got != want:
        at = next(i for i, (a, b) in enumerate(zip(got + "\0", want + "\0")) if a != b)
        pytest.fail(f"first difference at character {at}: npqwen {got[at:at + 40]!r} vs HF {want[at:at + 40]!r}")
    if tools:
        assert "<tools>" in got and "get_weather" in got and "<tool_response>" in got


@pytest.mark.parametrize("name", TEXTS)
def test_stream_pieces_never_split_a_character(tokenizers, name):
    ours, _ = tokenizers
    ids = ours.encode(TEXTS[name])
    decoder = ours.stream_decoder()
    pieces = [decoder.push(i) for i in ids] + [decoder.finish()]
    assert "".join(pieces) == ours.decode(ids) == TEXTS[name]
    assert not any("\ufffd" in p for p in pieces)
    if name == "chinese":
        assert pieces.count("") > 0   # some characters spanned several tokens and were held back


def test_stream_of_an_unfinished_character_ends_with_the_replacement_char(tokenizers):
    ours, _ = tokenizers
    ids = ours.encode("𠜎")[:1]   # the first byte-level token of a 4-byte character
    decoder = ours.stream_decoder()
    pieces = [decoder.push(i) for i in ids] + [decoder.finish()]
    assert "".join(pieces) == ours.decode(ids) == "\ufffd"


def test_broken_unicode_is_a_clear_error(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(NpqwenError, match="not valid Unicode"):
        ours.encode("bad \udcff surrogate")
    with pytest.raises(NpqwenError, match="list of"):
        ours.apply_chat_template("just a string")


def test_a_lone_surrogate_is_said_in_npqwens_words():
    from npqwen.tiny import tiny_tokenizer

    with pytest.raises(NpqwenError) as e:
        tiny_tokenizer().encode('ok \ud800 "')
    assert "character 3 is U+D800, half of a UTF-16 surrogate pair" in str(e.value)
    assert "TextEncodeInput" not in str(e.value)


@pytest.mark.parametrize("raw, pieces", [
    (b"a\x80b", ["a", "\ufffd", "b"]),                        # a stray continuation byte
    (b"\xe4a", ["", "\ufffda"]),                              # a lead byte, then no continuation
    (b"\xf0\x9f\x98a", ["", "", "", "\ufffda"]),              # four bytes that never complete a character
    (b"\xe4\xb8\xad\xff", ["", "", "\u4e2d", "\ufffd"]),      # a whole character, then a byte no UTF-8 has
])
def test_stream_writes_the_replacement_char_as_soon_as_bytes_cannot_be_a_character(raw, pieces):
    """Before: the decoder held every piece back until the text was valid again, which on random
    weights meant never (3,000 tokens came as one chunk at the end)."""
    from npqwen.tiny import tiny_tokenizer
    from npqwen.tokenizer import bytes_to_unicode

    tokenizer = tiny_tokenizer()
    ids = [tokenizer.token_to_id(bytes_to_unicode()[b]) for b in raw]
    decoder = tokenizer.stream_decoder()
    assert [decoder.push(i) for i in ids] == pieces
    assert "".join(pieces) + decoder.finish() == tokenizer.decode(ids)
