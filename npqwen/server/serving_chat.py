"""POST /v1/chat/completions: a conversation through the chat template, answered whole or streamed,
with Qwen3's reasoning and tool calls parsed out of the text (parsers.py), logprobs and n choices."""
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..chat_format import opens_reasoning
from ..errors import NpqwenError
from .constraints import chat_constraint
from .http import sse
from .parsers import StreamParser, finish_reason, parse_output
from .protocol import APIError, ChatCompletionRequest, template_messages
from .serving import Choice, Serving, token_drafts, token_logprobs, usage
from .tokenizer_process import LONG_TEXT_CHARS

# reasoning_effort as a thinking budget (tokens); "none" and "minimal" turn thinking off, "xhigh": no budget
EFFORT_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384, "xhigh": None}


class ServingChat(Serving):
    """POST /v1/chat/completions; ServingResponses builds on its template and requests."""

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        self.note_ignored(body)
        tools_on, tools = self.chat_tools(body)
        thinking = self.thinking(body) and not body.continue_final_message   # a continued message: all content
        top = (body.top_logprobs or 0) if body.logprobs else None
        opened, requests = await self.off_loop(self.chat_requests, body, thinking, tools, top)
        one_call = body.parallel_tool_calls is False
        choices = [Choice(i, r, StreamParser(thinking, tools=tools_on, opened=opened)) for i, r in enumerate(requests)]
        call = dict(id="chatcmpl-" + uuid.uuid4().hex, created=int(time.time()), model=self.model_name)
        queue = self.submit(requests)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            ids = body.return_token_ids
            return sse(self.chat_stream(queue, choices, call, include_usage, body.logprobs, one_call, ids, http),
                       lambda: self.loop.abort(requests))
        if not await self.collect(queue, choices, http):
            return Response(status_code=499)   # nobody is listening any more
        answers = []
        for c in choices:
            parsed = parse_output(c.text, thinking, tools=tools_on, opened=opened)
            tool_calls = parsed.tool_calls[:1] if one_call else parsed.tool_calls
            message = {"role": "assistant", "content": parsed.content if parsed.content or not tool_calls else None}
            if thinking:
                message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
            if tool_calls:
                message["tool_calls"] = tool_calls
            answers.append({"index": c.index, "message": message,
                            "logprobs": {"content": self.chat_logprobs(c.logprobs)} if body.logprobs else None,
                            "finish_reason": finish_reason(c.finish_reason, bool(tool_calls)),
                            **({"token_ids": c.token_ids} if body.return_token_ids else {}),
                            **({"speculative": c.drafts} if body.speculative is not None else {})})
        prompt_ids = {"prompt_token_ids": requests[0].prompt_ids} if body.return_token_ids else {}
        if body.prompt_logprobs is not None:   # vLLM's, at the top: the choices share the prompt
            prompt_ids["prompt_logprobs"] = self.vllm_prompt_logprobs(choices[0])
        return {**call, "object": "chat.completion", **prompt_ids, "choices": answers, "usage": usage(requests)}

    def chat_tools(self, body: ChatCompletionRequest) -> tuple[bool, list | None]:
        """(whether tool calls are parsed, the tools for the template)."""
        tools_on = bool(body.tools) and body.tool_choice != "none"
        return tools_on, [t.model_dump(exclude_none=True) for t in body.tools] if tools_on else None

    def chat_requests(self, body: ChatCompletionRequest, thinking: bool, tools, top) -> tuple:
        """(whether the template opened the reasoning, the engine requests); runs off the event loop.
        response_format, structured_outputs, or tool_choice "required" / named / strict functions
        constrain the answer (after its reasoning, with thinking on): constraints.py."""
        constraint = chat_constraint(body, self.tokenizer, self.config.vocab_size, self.llm.eos_token_ids)
        self.check_messages_size(body, body.max_new_tokens)
        try:
            prompt = self.chat_text(body, template_messages(body.messages), thinking, tools)
        except NpqwenError as e:
            raise APIError(400, str(e), "messages") from None
        opened = thinking and opens_reasoning(prompt)   # a template that opens the reasoning
        return opened, self.requests(prompt, body, body.max_new_tokens, top, "messages", body.prompt_logprobs,
                                     constraint, thinking, self.budget(body))

    def check_messages_size(self, body: ChatCompletionRequest, max_tokens: int | None):
        """Refuse messages that cannot fit before the template runs and they are tokenized: the template
        only adds text, so their texts' Tokenizer.fewest_tokens is a lower bound."""
        texts = [m.content if isinstance(m.content, str) else "".join(getattr(p, "text", "") for p in m.content)
                 for m in body.messages if m.content]
        if sum(map(len, texts)) > LONG_TEXT_CHARS:
            fewest = sum(self.tokenizer.fewest_tokens(t) for t in texts)
            self.check_room(fewest, max_tokens, "messages", f"{sum(map(len, texts))} characters, so at least ")

    def thinking(self, body: ChatCompletionRequest) -> bool:
        """chat_template_kwargs.enable_thinking if given; else off for reasoning_effort "none" or "minimal"
        (Qwen3 thinks or does not), on for the others; else the server's default (on)."""
        if body.chat_template_kwargs is not None and body.chat_template_kwargs.enable_thinking is not None:
            return body.chat_template_kwargs.enable_thinking
        if body.reasoning_effort is not None:
            return body.reasoning_effort not in ("none", "minimal")
        return bool(self.template_kwargs.get("enable_thinking", True))

    def budget(self, body: ChatCompletionRequest) -> int | None:
        """The request's thinking budget: thinking_token_budget, else its reasoning_effort's
        (EFFORT_BUDGETS), else the server's --thinking-budget; None: the engine's rule (engine/thinking.py)."""
        if body.thinking_token_budget is not None:
            return body.thinking_token_budget
        if body.reasoning_effort is not None:
            return EFFORT_BUDGETS.get(body.reasoning_effort)
        return self.thinking_budget

    def chat_text(self, body: ChatCompletionRequest, messages: list[dict], thinking: bool, tools) -> str:
        """The chat template's text; vLLM's add_generation_prompt false leaves out the assistant's
        opening, and continue_final_message cuts the text after the last message's words, as
        transformers does, so that the model goes on writing it."""
        extra = {k: v for k, v in self.template_kwargs.items() if k != "enable_thinking"}   # the server's defaults
        text = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, thinking, tools, **extra)
        if not body.continue_final_message:
            return text
        final = messages[-1]["content"]
        for words in (final, final.strip()):   # the template may have stripped the message
            at = text.rfind(words) if words else -1
            if at >= 0:
                return text[:at + len(words)]
        raise APIError(400, "continue_final_message: the last message has no text that the chat template kept, so "
                            "there is nothing to continue", "continue_final_message")

    async def chat_stream(self, queue, choices: list[Choice], call: dict, include_usage: bool, logprobs: bool,
                          one_call: bool, return_ids: bool, http: HTTPRequest):
        def chunk(c, delta, finish=None):
            """A chunk of choice c; it carries (and clears) the logprobs and ids c has not sent yet."""
            choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if logprobs:
                choice["logprobs"] = {"content": self.chat_logprobs(c.logprobs)}
            if return_ids:
                choice["token_ids"] = c.token_ids
            if c.request.params.speculative is not None:   # npqwen's: per token, its draft and whether it was kept
                choice["speculative"] = c.drafts
            c.logprobs, c.token_ids, c.drafts = [], [], []
            return {**call, "object": "chat.completion.chunk", "choices": [choice],
                    **({"usage": None} if include_usage else {})}

        for c in choices:
            first = chunk(c, {"role": "assistant", "content": ""})
            if return_ids and c.index == 0:   # the choices share one prompt
                first = {**first, "prompt_token_ids": c.request.prompt_ids}
            yield first
        async for index, out in self.outputs(queue, [c.request for c in choices], http):
            c = choices[index]
            c.logprobs += token_logprobs(out)
            c.token_ids += out.token_ids
            c.drafts += token_drafts(out)
            deltas = c.parser.feed(out.text)
            if out.finished:
                deltas += c.parser.finish()
            for delta in deltas:
                if one_call and any(call_delta["index"] > 0 for call_delta in delta.get("tool_calls", [])):
                    continue
                if "reasoning_content" in delta:
                    delta["reasoning"] = delta["reasoning_content"]
                yield chunk(c, delta)
            if out.finished:
                yield chunk(c, {}, finish_reason(out.finish_reason, c.parser.n_calls > 0))
        if include_usage:
            yield {**call, "object": "chat.completion.chunk", "choices": [],
                   "usage": usage([c.request for c in choices])}

    def chat_logprobs(self, entries) -> list[dict]:
        def one(token, logprob):
            return {"token": self.tokenizer.decode([token]), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token))}
        return [{**one(token, lp), "top_logprobs": [one(t, l) for t, l in top]} for token, lp, top in entries]
