"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), which the anthropic SDKs
and Claude Code speak (ANTHROPIC_BASE_URL pointed at the server), over the same engine requests as
a chat.

A Messages call is turned into a chat completion request (system and blocks into chat messages,
tools into chat tools, tool_choice any/tool into the chat's required/named choice, output_config.format
into response_format, thinking into enable_thinking, budget_tokens into thinking_token_budget,
output_config.effort into reasoning_effort's budgets) and run as one: the same template, parsers and
constraints. What comes back is written as content blocks: a `thinking` block for Qwen3's
reasoning, a `text` block, a `tool_use` block per call. Streamed, as Anthropic's events:
message_start, ping, per block content_block_start / _delta (thinking_delta, text_delta,
input_json_delta) / _stop, then message_delta (stop_reason, usage) and message_stop; a failure
after the stream began is an `error` event. Errors are in Anthropic's shape (http.py picks it by path).

Usage as Anthropic counts it: input_tokens are the prompt tokens the prefix cache did not serve,
cache_read_input_tokens those it did (so count_tokens = input_tokens + cache_read_input_tokens).
"""
import asyncio
import contextlib
import json
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import ValidationError

from ..errors import NpqwenError
from .engine_loop import EngineStopped
from .http import EventStream
from .parsers import StreamParser, completed_calls, parse_output
from .protocol import APIError, ChatCompletionRequest, template_messages
from .protocol_messages import CountTokensRequest, CustomTool, MediaBlock, MessagesRequest, anthropic_error
from .serving import Choice
from .serving_chat import ServingChat

PING_SECONDS = 10   # a ping this often while nothing else is sent (a long prompt being read)
# Claude Code's first system block: its cch= changes on every request, and at the prompt's start it
# would leave the prefix cache nothing to reuse; it is for Anthropic's billing, not the model
BILLING_HEADER = "x-anthropic-billing-header:"


def tool_use_id(index: int) -> str:
    """An Anthropic-style tool-use id, "toolu_" and 24 hex digits; the index is not used."""
    return "toolu_" + uuid.uuid4().hex[:24]


def block_text(blocks, where: str) -> str:
    """The text of a tool_result's blocks; an image or a document is a 400 (this server reads text)."""
    for j, block in enumerate(blocks):
        if isinstance(block, MediaBlock):
            raise refused(block, f"{where}[{j}]", "a tool result")
    return "".join(block.text for block in blocks)


def system_text(system, where: str) -> str:
    """A system prompt's text: a string, or its text blocks joined (Claude Code's billing header left out)."""
    if isinstance(system, str):
        return system
    for j, block in enumerate(system):
        if block.type != "text":
            raise refused(block, f"{where}[{j}]", "a system message")
    return "\n\n".join(block.text for block in system if not block.text.startswith(BILLING_HEADER))


def to_messages(body: CountTokensRequest) -> list[dict]:
    """The conversation as chat messages: system first; a system message among the messages stays where
    it stands (the template writes it as a system turn there); a user's tool_result blocks become
    tool messages and its text blocks a user message, in their order; an assistant's thinking, text
    and tool_use blocks become one assistant message (reasoning_content, content, tool_calls)."""
    system = system_text(body.system, "system") if body.system is not None else ""
    messages = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(body.messages):
        if m.role == "system":
            messages.append({"role": "system", "content": system_text(m.content, f"messages[{i}].content")})
            continue
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            message = {"role": "assistant", "content": ""}
            for j, block in enumerate(m.content):
                if block.type == "text":
                    message["content"] += block.text
                elif block.type == "thinking":
                    message["reasoning_content"] = message.get("reasoning_content", "") + block.thinking
                elif block.type == "tool_use":
                    message.setdefault("tool_calls", []).append({"id": block.id, "type": "function", "function": {
                        "name": block.name, "arguments": block.input}})
                elif block.type != "redacted_thinking":
                    raise refused(block, f"messages[{i}].content[{j}]", "an assistant message")
            messages.append(message)
            continue
        user = None   # the user message being put together from text blocks
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                if user is None:
                    user = {"role": "user", "content": ""}
                    messages.append(user)
                user["content"] += block.text
            elif block.type == "tool_result":
                content = block.content if isinstance(block.content, str) else \
                    block_text(block.content or [], f"{where}.content")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {content}" if block.is_error else content})
                user = None
            else:
                raise refused(block, where, "a user message")
    return messages


def refused(block, where: str, place: str) -> APIError:
    """The 400 for a block that cannot be read here: an image or a document, or a block in the wrong role."""
    if isinstance(block, MediaBlock):
        return APIError(400, f"{where} is a {block.type!r} block: this server reads text only (Qwen3 has no "
                             f"vision); send text blocks", f"{where}.type", "unsupported")
    return APIError(400, f"{where}: a {block.type!r} block has no place in {place}", f"{where}.type")


def to_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request a Messages call runs as (so that every check a chat gets applies)."""
    if body.thread not in (None, False):   # the SDK's tool runner sends one, and goes on without on this answer
        raise APIError(400, "npqwen keeps no message threads: send the whole conversation without 'thread'",
                       "thread", "unsupported", details={"error_code": "thread_unsupported_request",
                                                         "unsupported": []})
    chat = {"model": body.model, "messages": to_messages(body)}
    thinking = body.thinking is not None and body.thinking.type != "disabled"   # off unless asked, as Anthropic's
    chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    if isinstance(body, MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        for name, value in (("temperature", body.temperature), ("top_p", body.top_p), ("top_k", body.top_k),
                            ("stop", body.stop_sequences)):
            if value is not None:
                chat[name] = value
    for i, tool in enumerate(body.tools or []):
        if not isinstance(tool, CustomTool):
            raise APIError(400, f"tools[{i}] is Anthropic's server tool {tool.type!r}, which npqwen does not run: "
                                f"give client tools (name, description, input_schema)", f"tools[{i}].type",
                           "unsupported")
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": tool_text(t)} if tool_text(t)
                                                              else {})}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    fmt = body.output_format or (body.output_config.format if body.output_config else None)
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if thinking and body.thinking.type == "enabled" and isinstance(body, MessagesRequest):
        chat["thinking_token_budget"] = enabled_budget(body)
    effort = body.output_config.effort if body.output_config else None
    if thinking and effort is not None:   # the chat's reasoning_effort budgets; "max": no cap
        chat["reasoning_effort"] = "xhigh" if effort == "max" else effort
    try:
        request = ChatCompletionRequest.model_validate(chat)
        request.check_supported()
    except ValidationError as e:   # a message the blocks made: say where in the conversation
        error = e.errors()[0]
        raise APIError(400, f"messages: {error['msg']} (at {'.'.join(map(str, error['loc']))} of the conversation "
                            f"as chat messages)", "messages") from None
    except APIError as e:
        raise in_messages_names(e) from None
    return request


def tool_text(tool: CustomTool) -> str:
    """A tool's description as the model reads it: its input_examples, if any, follow it (Anthropic puts
    them in the prompt beside the tool's schema), one JSON object a line."""
    if not tool.input_examples:
        return tool.description or ""
    examples = "\n".join(json.dumps(example, ensure_ascii=False) for example in tool.input_examples)
    return f"{tool.description}\n\nInput examples:\n{examples}" if tool.description else f"Input examples:\n{examples}"


def enabled_budget(body: MessagesRequest) -> int:
    """thinking {"type": "enabled", "budget_tokens": N}: the reasoning's most tokens, the chat's
    thinking_token_budget (the engine writes the end of the thinking when it is spent)."""
    budget = body.thinking.budget_tokens
    if budget is None:
        raise APIError(400, "thinking of type 'enabled' needs budget_tokens", "thinking.budget_tokens")
    if budget >= body.max_tokens:
        raise APIError(400, f"max_tokens ({body.max_tokens}) must be greater than thinking.budget_tokens "
                            f"({budget})", "thinking.budget_tokens")
    return budget


def in_messages_names(e: APIError) -> APIError:
    """A chat request's error said with the Messages API's names (output_config.format, not response_format)."""
    names = {"response_format.json_schema.schema": "output_config.format.schema", "response_format":
             "output_config.format", "stop": "stop_sequences"}
    param = e.param or ""
    param = names.get(param, param.replace(".function.parameters", ".input_schema"))
    e.param = param or None
    for chat_name, name in (("response_format.json_schema.schema", "output_config.format.schema"),
                            ("response_format", "output_config.format"), ("tool_choice 'required'", "tool_choice any")):
        e.message = e.message.replace(chat_name, name)
    return e


class ServingMessages(ServingChat):
    """A Messages call runs as the chat it translates to (ServingChat's template, requests and parser)."""

    async def create(self, body: MessagesRequest, http: HTTPRequest):
        """POST /v1/messages."""
        self.count("messages")
        self.check_model(body.model)
        chat = to_chat_request(body)
        tools_on, tools = self.chat_tools(chat)
        thinking = self.thinking(chat)
        try:   # output_config.format and tool_choice any/tool constrain the answer (constraints.py)
            opened, requests = await self.off_loop(self.chat_requests, chat, thinking, tools, None)
        except APIError as e:
            raise in_messages_names(e) from None
        choice = Choice(0, requests[0], StreamParser(thinking, tool_use_id, tools=tools_on, opened=opened))
        message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                   "model": self.model_name}
        one_call = chat.parallel_tool_calls is False
        queue = self.submit(requests)
        if body.stream:
            return EventStream(self.events(queue, choice, message, body, one_call, http),
                               lambda: self.loop.abort(requests))
        if not await self.collect(queue, [choice], http):
            return Response(status_code=499)
        parsed = parse_output(choice.text, thinking, tool_use_id, tools=tools_on, opened=opened)
        calls = parsed.tool_calls[:1] if one_call else parsed.tool_calls
        content = [{"type": "thinking", "thinking": parsed.reasoning, "signature": ""}] if parsed.reasoning else []
        if parsed.content or not calls:
            content.append({"type": "text", "text": parsed.content})
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": json.loads(c["function"]["arguments"])} for c in calls]
        return {**message, "content": content, **self.stop(choice, body, bool(calls)),
                "usage": {**self.usage(choice.request), "output_tokens": len(choice.request.output_ids)}}

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        """POST /v1/messages/count_tokens: the prompt's tokens, as /v1/messages would read them."""
        self.count("count_tokens")
        self.check_model(body.model)
        chat = to_chat_request(body)
        _, tools = self.chat_tools(chat)
        return {"input_tokens": len(await self.off_loop(self.prompt_ids, chat, tools))}

    def check_room(self, tokens: int, max_tokens: int | None, param: str, at_least: str = "") -> int:
        """max_tokens is a ceiling here: Claude Code asks for 32000 whatever its prompt, so the answer
        gets what the context and the KV pool leave, up to max_tokens (a 400 only when nothing is left)."""
        room = super().check_room(tokens, None, param, at_least)
        return room if max_tokens is None else min(max_tokens, room)

    def prompt_ids(self, chat: ChatCompletionRequest, tools) -> list[int]:
        self.check_messages_size(chat, None)   # count_tokens too refuses what cannot fit, before tokenizing it
        try:
            return self.encode(self.chat_text(chat, template_messages(chat.messages), self.thinking(chat), tools))
        except NpqwenError as e:
            raise APIError(400, str(e), "messages") from None

    def count(self, endpoint: str):
        if self.loop.metrics is not None:
            self.loop.metrics.api_requests.labels(endpoint).inc()

    @staticmethod
    def usage(request) -> dict:
        """Anthropic's input counts: the prompt tokens the prefix cache served are cache reads, not input."""
        cached = request.prompt_cached or 0
        return {"input_tokens": len(request.prompt_ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached}

    @staticmethod
    def stop(choice: Choice, body: MessagesRequest, called: bool) -> dict:
        """stop_reason and stop_sequence: max_tokens, tool_use, stop_sequence (which one) or end_turn."""
        reason, hit = choice.finish_reason, choice.request.stop
        if reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if hit is not None and hit in (body.stop_sequences or []):
            return {"stop_reason": "stop_sequence", "stop_sequence": hit}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    async def events(self, queue, choice: Choice, message: dict, body: MessagesRequest, one_call: bool, http):
        """Anthropic's events as SSE lines: each block is started, grows by deltas and is stopped
        before the next one starts."""
        blocks: list[str] = []   # the type of each block started
        open_block = None        # "thinking" or "text" while one is growing

        def event(kind: str, **fields) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

        def close() -> list[str]:
            nonlocal open_block
            if open_block is None:
                return []
            open_block = None
            return [event("content_block_stop", index=len(blocks) - 1)]

        def grow(kind: str, text: str) -> list[str]:
            nonlocal open_block
            lines = []
            if open_block != kind:
                lines += close()
                blocks.append(kind)
                open_block = kind
                start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                    {"type": "text", "text": ""}
                lines.append(event("content_block_start", index=len(blocks) - 1, content_block=start))
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
                {"type": "text_delta", "text": text}
            return lines + [event("content_block_delta", index=len(blocks) - 1, delta=delta)]

        def tool_use(call: dict) -> list[str]:
            lines = close()
            blocks.append("tool_use")
            index = len(blocks) - 1
            return lines + [event("content_block_start", index=index, content_block={
                                "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}),
                            event("content_block_delta", index=index, delta={
                                "type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
                            event("content_block_stop", index=index)]

        request = choice.request
        yield event("message_start", message={**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": {"input_tokens": len(request.prompt_ids),
                                                        "cache_creation_input_tokens": 0,
                                                        "cache_read_input_tokens": 0, "output_tokens": 0}})
        yield event("ping")
        pending: dict[int, dict] = {}   # tool calls started, by index (parsers.completed_calls)
        calls = 0
        try:
            async with contextlib.aclosing(pinging(self.outputs(queue, [request], http))) as outputs:
                async for output in outputs:
                    if output is None:
                        yield event("ping")
                        continue
                    _, out = output
                    choice.text += out.text
                    choice.finish_reason = out.finish_reason
                    for delta in choice.parser.feed(out.text) + (choice.parser.finish() if out.finished else []):
                        if "reasoning_content" in delta:
                            for line in grow("thinking", delta["reasoning_content"]):
                                yield line
                        elif delta.get("content"):
                            for line in grow("text", delta["content"]):
                                yield line
                        for whole in completed_calls(pending, delta):
                            calls += 1
                            if not (one_call and calls > 1):
                                for line in tool_use(whole):
                                    yield line
        except EngineStopped as e:   # Anthropic's error event ends the stream
            _, error = anthropic_error(APIError(e.status, str(e), type="server_error"))
            yield event("error", error=error["error"])
            return
        for line in close():
            yield line
        if not blocks:   # nothing at all was written: an empty text block, as the whole answer has
            for line in grow("text", "") + close():
                yield line
        yield event("message_delta", delta=self.stop(choice, body, calls > 0),
                    usage={**self.usage(request), "output_tokens": len(request.output_ids)})
        yield event("message_stop")


async def pinging(outputs, seconds: float = PING_SECONDS):
    """The items of an async generator, with None each time `seconds` pass without one (time for a ping)."""
    pending = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(outputs.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=seconds)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await outputs.aclose()
