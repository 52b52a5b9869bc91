"""`npqwen serve` through the official openai client: a real server on 127.0.0.1 (uvicorn in a thread)
over the built-in tiny model, and over a scripted model where the exact text matters."""
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import serving  # noqa: E402
from serving import http_json, reference, tiny_server  # noqa: E402,F401  (fixtures)
from tolerance import logprob_tolerance, rounding_tolerance  # noqa: E402

THINK_OFF = "<think>\n\n</think>\n\n"     # what the chat template adds with enable_thinking false
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                              "parameters": {"type": "object", "properties": {}}}}


def call_text(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


SCRIPT = {
    "Q-THINK": "<think>\nI reason.\nStep two.\n</think>\n\nThe answer is 4.",
    "Q-NOTHINK": THINK_OFF + "Plain answer.",
    "Q-CUT": "<think>\nA long line of reasoning that will be cut off by max_tokens.",
    "Q-WEATHER": "<think>\nNeed the weather.\n</think>\n\n" + call_text("get_weather", {"city": "Paris"}),
    "Q-TWO": THINK_OFF + "Checking.\n\n" + call_text("get_time", {}) + "\n" + call_text("get_weather", {"city": "Oslo"}),
    "Q-FORCED": THINK_OFF + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "Q-REQUIRED": THINK_OFF + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "TOOLRESULT-17": THINK_OFF + "It is 17 degrees.",
    "Q-SCRIPT": THINK_OFF + "<script>window.pwned = 1</script> & [link](javascript:alert(1))",
}


@pytest.fixture(scope="module")
def scripted_server():
    yield from serving.scripted_server(SCRIPT)


def chat(server, content, **kwargs):
    return server.client().chat.completions.create(model="test-model",
                                                   messages=[{"role": "user", "content": content}], **kwargs)


def stream_chat(server, content, **kwargs):
    """(chunks, reasoning, content, tool calls as {index: {id, name, arguments}}) of a streamed chat."""
    chunks = list(chat(server, content, stream=True, **kwargs))
    reasoning = content_text = ""
    calls = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content_text += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name, "the first delta of a call carries its id and name"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return chunks, reasoning, content_text, calls


# -- the tiny model: shapes, counts, sampling --

def test_models_and_health(tiny_server):
    assert [m.id for m in tiny_server.client().models.list().data] == ["test-model"]
    assert http_json("GET", tiny_server.url + "/health") == (200, {"status": "ok"})
    metrics = http_json("GET", tiny_server.url + "/metrics")[1]
    for name in ("npqwen:num_requests_running", "npqwen:num_requests_waiting", "npqwen:kv_pages_used",
                 "npqwen:prefix_cache_hit_tokens_total", "npqwen:generation_tokens_total",
                 "npqwen:time_to_first_token_seconds_bucket"):
        assert name in metrics, name


def test_chat_streamed_joins_to_non_streamed_and_usage_counts_tokens(tiny_server, reference):
    question = "What is a page table?"
    kwargs = dict(temperature=0, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    whole = chat(tiny_server, question, **kwargs)
    chunks, reasoning, content, _ = stream_chat(tiny_server, question, stream_options={"include_usage": True},
                                                **kwargs)
    assert content == whole.choices[0].message.content and reasoning == ""
    prompt = reference.chat_prompt([{"role": "user", "content": question}], enable_thinking=False)
    expected = reference.generate(prompt, max_new_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected.text, (whole.choices[0].message.content, expected.text)
    # usage: the tokenizer's count of the prompt (also through /tokenize), every generated token
    n_prompt = len(reference.tokenizer.encode(prompt))
    _, counted = http_json("POST", tiny_server.url + "/tokenize", {"messages": [{"role": "user", "content": question}],
                                                              "chat_template_kwargs": {"enable_thinking": False}})
    assert counted["count"] == n_prompt == whole.usage.prompt_tokens
    assert whole.usage.completion_tokens == len(expected.token_ids) == 12
    assert whole.usage.total_tokens == n_prompt + 12
    # the stream: a role first, one finish_reason, usage last with no choices
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streamed_and_not(tiny_server, reference):
    client = tiny_server.client()
    expected = reference.generate("The capital of France is", max_new_tokens=10, temperature=0)
    whole = client.completions.create(model="test-model", prompt="The capital of France is", max_tokens=10,
                                      temperature=0)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(reference.tokenizer.encode("The capital of France is"))
    streamed = client.completions.create(model="test-model", prompt="The capital of France is", max_tokens=10,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    # token ids, and a list of prompts: one choice per prompt, in order
    ids = reference.tokenizer.encode("The capital of France is")
    many = client.completions.create(model="test-model", prompt=[ids, reference.tokenizer.encode("Once upon")],
                                     max_tokens=10, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == expected.text
    assert many.choices[1].text == reference.generate("Once upon", max_new_tokens=10, temperature=0).text


def test_seed_reproducible(tiny_server):
    client = tiny_server.client()
    runs = [client.completions.create(model="test-model", prompt="Roll the dice:", max_tokens=16, temperature=1.0,
                                      seed=seed).choices[0].text for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2], runs


def test_stop_strings_excluded(tiny_server, reference):
    full = reference.generate("Stop here", max_new_tokens=24, temperature=0).text
    stop = full[8:10]
    before = full[:full.index(stop)]
    out = tiny_server.client().completions.create(model="test-model", prompt="Stop here", max_tokens=24,
                                                  temperature=0, stop=[stop, "never-appears"])
    assert out.choices[0].text == before and out.choices[0].finish_reason == "stop"


def test_n_choices_share_the_prompt_pages(tiny_server):
    engine = tiny_server.engine
    prompt = "A shared prompt of some length: " + "abcdefgh" * 8        # 96 byte tokens = 6 pages of 16
    hits = engine.cache.hit_tokens
    out = tiny_server.client().completions.create(model="test-model", prompt=prompt, max_tokens=8, n=3,
                                                  temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1, "the choices drew the same text"
    assert out.usage.prompt_tokens == 96 and out.usage.completion_tokens == 24
    # choices 1 and 2 waited for choice 0 to read the prompt, then took its 5 full pages
    # (the last page, holding the final prompt token, is computed by each)
    assert engine.cache.hit_tokens - hits == 2 * 5 * 16
    # streamed: every choice gets a role first and exactly one finish_reason
    chunks = list(tiny_server.client().chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, stream=True, seed=1))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert sum(c.finish_reason is not None for c in mine) == 1 and mine[-1].finish_reason in ("length", "stop")


def test_logprobs_present_sorted_and_the_samplers(tiny_server):
    out = chat(tiny_server, "Tell me", max_tokens=10, temperature=1.0, top_p=1.0, logprobs=True, top_logprobs=5,
               seed=0, extra_body={"top_k": 0})   # seeded: an unseeded draw may hit eos before 10 tokens
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens == 10
    assert sum(e.logprob for e in entries) <= 0
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 5
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert e.logprob <= tops[0] + 1e-12
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or "\ufffd" in e.token
    # greedy: the chosen token is the most likely one; with top_k 3 only 3 candidates exist
    out = chat(tiny_server, "Tell me", max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    for e in out.choices[0].logprobs.content:
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    out = chat(tiny_server, "Tell me", max_tokens=6, temperature=1.0, logprobs=True, top_logprobs=10, seed=0,
               extra_body={"top_k": 3})
    for e in out.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 3
        # the draw's distribution: a float32 softmax over the 3 candidates
        assert abs(np.exp([t.logprob for t in e.top_logprobs]).sum() - 1) <= rounding_tolerance(3)


def test_frequency_penalty_against_a_hand_computation(tiny_server, reference):
    ids = reference.tokenizer.encode("aaaa bbbb aaaa bbbb")
    penalty, n = 1.5, 12
    out = tiny_server.client().completions.create(model="test-model", prompt=ids, max_tokens=n, temperature=0,
                                                  frequency_penalty=penalty, logprobs=2)
    got = out.choices[0].logprobs
    # by hand: full forward of the sequence so far; subtract penalty x count of each generated token
    tokens, logprobs = [], []
    for _ in range(n):
        logits = np.asarray(reference.forward(ids + tokens)[-1], np.float64)
        logits -= penalty * np.bincount(tokens, minlength=logits.size)
        token = int(np.argmax(logits))
        logprobs.append(logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
        tokens.append(token)
    assert out.choices[0].text == reference.tokenizer.decode(tokens)
    # the server's decode steps against a full forward pass each time: the same sums, blocked otherwise
    bound = logprob_tolerance(reference.config, len(ids) + n, reference.forward(ids + tokens))
    assert np.max(np.abs(np.array(got.token_logprobs) - logprobs)) <= bound, (got.token_logprobs, logprobs)
    plain = reference.generate(ids, max_new_tokens=n, temperature=0)
    assert plain.token_ids != tokens, "the penalty changed nothing: pick a prompt where it matters"


# -- scripted answers: reasoning and tool calls --

def test_reasoning_with_thinking_on(scripted_server):
    out = chat(scripted_server, "Q-THINK")
    message = out.choices[0].message
    assert message.reasoning_content == "I reason.\nStep two." == message.reasoning
    assert message.content == "The answer is 4." and out.choices[0].finish_reason == "stop"
    _, reasoning, content, calls = stream_chat(scripted_server, "Q-THINK")
    assert (reasoning, content, calls) == ("I reason.\nStep two.", "The answer is 4.", {})


def test_reasoning_with_thinking_off(scripted_server):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(scripted_server, "Q-NOTHINK", extra_body=off).choices[0].message
    assert message.content == "Plain answer." and getattr(message, "reasoning_content", None) is None
    _, reasoning, content, _ = stream_chat(scripted_server, "Q-NOTHINK", extra_body=off)
    assert (reasoning, content) == ("", "Plain answer.")


def test_answer_cut_off_while_thinking_is_all_reasoning(scripted_server):
    out = chat(scripted_server, "Q-CUT", max_tokens=12)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content == "" and out.choices[0].message.reasoning_content.startswith("A long")
    _, reasoning, content, _ = stream_chat(scripted_server, "Q-CUT", max_tokens=12)
    assert content == "" and reasoning == out.choices[0].message.reasoning_content


def test_one_tool_call_streamed_and_not(scripted_server):
    out = chat(scripted_server, "Q-WEATHER", tools=[WEATHER_TOOL])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "Need the weather."
    (tc,) = choice.message.tool_calls
    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    chunks, reasoning, content, calls = stream_chat(scripted_server, "Q-WEATHER", tools=[WEATHER_TOOL])
    assert reasoning == "Need the weather." and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_two_tool_calls_with_empty_arguments(scripted_server):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(scripted_server, "Q-TWO", tools=[TIME_TOOL, WEATHER_TOOL], extra_body=off).choices[0].message
    assert message.content == "Checking."
    assert [(t.function.name, t.function.arguments) for t in message.tool_calls] == [
        ("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    assert len({t.id for t in message.tool_calls}) == 2
    chunks, _, content, calls = stream_chat(scripted_server, "Q-TWO", tools=[TIME_TOOL, WEATHER_TOOL], extra_body=off)
    assert content == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", "{}"),
                                                                     ("get_weather", '{"city": "Oslo"}')]
    sent = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool" not in sent and "</" not in sent, "a tag leaked into the content"
    # parallel_tool_calls false: the first call only
    message = chat(scripted_server, "Q-TWO", tools=[TIME_TOOL, WEATHER_TOOL], extra_body=off,
                   parallel_tool_calls=False).choices[0].message
    assert [t.function.name for t in message.tool_calls] == ["get_time"]


def test_tool_choice_none_named_and_required(scripted_server):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = chat(scripted_server, "Q-TWO", tools=[TIME_TOOL, WEATHER_TOOL], tool_choice="none", extra_body=off)
    assert out.choices[0].message.tool_calls is None and "<tool_call>" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(scripted_server, "Q-FORCED", tools=[TIME_TOOL, WEATHER_TOOL], tool_choice=named)
    (tc,) = out.choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Rome"})
    _, _, content, calls = stream_chat(scripted_server, "Q-FORCED", tools=[TIME_TOOL, WEATHER_TOOL], tool_choice=named)
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather"]
    out = chat(scripted_server, "Q-REQUIRED", tools=[TIME_TOOL, WEATHER_TOOL], tool_choice="required")
    assert [t.function.name for t in out.choices[0].message.tool_calls] == ["get_time"]


def test_tool_results_render_through_the_chat_template(scripted_server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "TOOLRESULT-17"}]
    out = scripted_server.client().chat.completions.create(
        model="test-model", messages=messages, tools=[WEATHER_TOOL],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == "It is 17 degrees."
    ids = http_json("POST", scripted_server.url + "/tokenize", {"messages": messages})[1]["tokens"]
    text = http_json("POST", scripted_server.url + "/detokenize", {"tokens": ids})[1]["prompt"]
    assert "<tool_response>\nTOOLRESULT-17\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text


def test_nothing_above_made_either_server_log_an_error(tiny_server, scripted_server):
    for server in (tiny_server, scripted_server):
        assert not server.errors, [r.getMessage() for r in server.errors]
