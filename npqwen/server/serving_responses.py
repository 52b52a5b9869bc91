"""OpenAI's Responses API (POST /v1/responses), which the newest clients use by default (the AI
SDK's openai(model), OpenAI's Agents SDK), over the same engine requests as a chat.

A Responses call is turned into a chat completion request (its input items into messages, its
function tools into chat tools) and run as one; what comes back is written as output items: a
`reasoning` item for Qwen3's reasoning, a `message` with the answer, a `function_call` for
each tool call. Streamed, as OpenAI's typed events: response.created, response.in_progress,
for each item output_item.added, its deltas (reasoning_text, output_text, function_call_arguments)
and output_item.done, then response.completed (or response.incomplete when max_output_tokens cut
it short). npqwen keeps no responses: previous_response_id is a 400 (send the whole conversation
as input, as clients do with store: false).
"""
import contextlib
import json
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import ValidationError

from ..chat_format import THINK_CLOSE
from .engine_loop import EngineStopped
from .http import EventStream
from .parsers import StreamParser, completed_calls, finish_reason, parse_output
from .protocol import APIError, ChatCompletionRequest
from .protocol_responses import RESPONSE_FIELDS_IGNORED, FunctionToolChoice, ResponsesRequest
from .serving import Choice, usage
from .serving_chat import ServingChat


def to_messages(body: ResponsesRequest) -> list[dict]:
    """The conversation as chat messages: instructions as the system message, then each input item;
    a reasoning item and the function calls after it join the assistant message they belong to,
    and a function call's output is a tool message."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    reasoning, assistant = None, None   # the assistant turn being put together

    def turn() -> dict:
        nonlocal assistant, reasoning
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
            if reasoning:
                assistant["reasoning_content"] = reasoning
            reasoning = None
            messages.append(assistant)
        return assistant

    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            message = turn()
            message["content"] += item_text(item, i, ("output_text", "input_text", "refusal"))
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise APIError(400, f"input[{i}].role must be user, system, developer or assistant, got {role!r}",
                               f"input[{i}].role")
            messages.append({"role": role, "content": item_text(item, i, ("input_text",))})
            assistant = None
        elif kind == "reasoning":
            field = "content" if item.get("content") else "summary"
            parts = item.get(field) or []
            bad = next((j for j, p in enumerate(parts) if not isinstance(p, dict)
                        or not isinstance(p.get("text"), str)), None) if isinstance(parts, list) else 0
            if bad is not None:
                raise APIError(400, f"input[{i}].{field}[{bad}] must be a part with a text string",
                               f"input[{i}].{field}[{bad}]")
            reasoning = "".join(p["text"] for p in parts)
            assistant = None
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(400, f"input[{i}].{key} must be a string", f"input[{i}].{key}")
            turn().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"input[{i}].call_id must be a string", f"input[{i}].call_id")
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise APIError(400, f"input[{i}].output must be a string or a list of text parts", f"input[{i}].output")
            text = output if isinstance(output, str) else item_text({"content": output}, i, ("input_text",))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            assistant = None
        elif kind == "item_reference":
            raise APIError(400, f"input[{i}] refers to a stored item, and npqwen keeps none: send the item itself",
                           f"input[{i}].type", "unsupported")
        else:
            raise APIError(400, f"input[{i}] is a {kind!r} item, which npqwen does not serve (it takes messages, "
                                f"reasoning, function_call and function_call_output items)", f"input[{i}].type",
                           "unsupported")
    return messages


def item_text(item: dict, i: int, kinds: tuple[str, ...]) -> str:
    """The text of a message item: its content string, or its text parts joined."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of parts", f"input[{i}].content")
    text = ""
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"input[{i}].content[{j}] is a part of type {kind!r}: this model reads text only "
                                f"(Qwen3 has no vision or audio); send text parts", f"input[{i}].content[{j}].type",
                           "unsupported")
        if kind not in kinds or not isinstance(part.get("text", part.get("refusal")), str):
            raise APIError(400, f"input[{i}].content[{j}] must be a text part ({' or '.join(kinds)})",
                           f"input[{i}].content[{j}]")
        text += part.get("text", part.get("refusal"))
    return text


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request a Responses call runs as (so that every check a chat gets applies)."""
    chat = {"model": body.model, "messages": to_messages(body)}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "steering", "feature_edits"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if body.thinking_token_budget is not None:
        chat["thinking_token_budget"] = body.thinking_token_budget
    if body.text is not None and body.text.format is not None:   # json_object, json_schema: constrained
        fmt = body.text.format.model_dump()
        chat["response_format"] = {"type": fmt["type"], **({"json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
            if fmt["type"] == "json_schema" else {})}
    try:
        request = ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:   # a message the input items made: say which field of the Responses call
        error = e.errors()[0]
        raise APIError(400, f"input: {error['msg']} (at {'.'.join(map(str, error['loc']))} of the conversation)",
                       "input") from None
    try:
        request.check_supported()
    except APIError as e:
        raise in_responses_names(e) from None
    return request


def in_responses_names(e: APIError) -> APIError:
    """A chat request's error said with the Responses API's names (text.format, not response_format)."""
    names = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}
    param = e.param or ""
    param = names.get(param, param.replace("response_format.json_schema", "text.format")
                      .replace("response_format", "text.format").replace(".function.", "."))
    e.param = param or None
    e.message = e.message.replace("response_format.json_schema", "text.format").replace("response_format",
                                                                                         "text.format")
    return e


class Output:
    """The output items of one response, built as the answer comes (streamed) or at once."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None      # the reasoning or message item still growing

    def reasoning(self) -> dict:
        return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}

    def message(self) -> dict:
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}

    def function_call(self, call: dict) -> dict:
        return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


class ServingResponses(ServingChat):
    """A Responses call runs as the chat it translates to (ServingChat's template, requests and parser)."""

    async def respond(self, body: ResponsesRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        self.note_ignored(body, RESPONSE_FIELDS_IGNORED)
        chat = to_chat_request(body)
        tools_on, tools = self.chat_tools(chat)
        thinking = self.thinking(chat)
        try:   # text.format and tool_choice constrain the answer (constraints.py)
            opened, requests = await self.off_loop(self.fitting_requests, chat, thinking, tools,
                                                   body.truncation == "auto")
        except APIError as e:
            raise in_responses_names(e) from None
        choice = Choice(0, requests[0], StreamParser(thinking, tools=tools_on, opened=opened))
        base = self.base(body, chat)
        queue = self.submit(requests)
        if body.stream:
            return EventStream(self.events(queue, choice, base, thinking, tools_on, opened, body, http),
                               lambda: self.loop.abort(requests))
        if not await self.collect(queue, [choice], http):
            return Response(status_code=499)
        parsed = parse_output(choice.text, thinking, tools=tools_on, opened=opened)
        out = Output()
        if parsed.reasoning:
            item = out.reasoning()
            item["content"][0]["text"] = parsed.reasoning
            out.items.append(item)
        calls = parsed.tool_calls[:body.max_tool_calls or None]
        if body.parallel_tool_calls is False:
            calls = calls[:1]
        if parsed.content or not (calls or out.items):   # an answer cut off while thinking has no message
            item = out.message()
            item["content"][0]["text"] = parsed.content
            out.items.append(item)
        out.items += [out.function_call(call) for call in calls]
        return self.final(base, out.items, choice, bool(calls))

    def base(self, body: ResponsesRequest, chat: ChatCompletionRequest) -> dict:
        """The response object's fields that do not depend on the answer."""
        return {"id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "error": None, "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": self.model_name, "output": [],
                "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
                "store": False, "temperature": body.temperature, "top_p": body.top_p,
                "text": {"format": body.text.format.model_dump() if body.text and body.text.format
                         else {"type": "text"}},
                "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionToolChoice)
                else body.tool_choice or "auto",
                "tools": [t.model_dump() for t in body.tools or []], "truncation": body.truncation or "disabled",
                "metadata": body.metadata or {}, "user": body.user, "usage": None}

    def final(self, base: dict, items: list[dict], choice: Choice, called: bool) -> dict:
        """The finished response: status completed, or incomplete when max_output_tokens cut the answer."""
        cut = finish_reason(choice.finish_reason, called) == "length"
        for item in items:
            item["status"] = "incomplete" if cut and item["type"] != "function_call" else "completed"
        request = choice.request
        think_end = self.tokenizer.token_to_id(THINK_CLOSE)
        reasoning = (request.output_ids.index(think_end) + 1 if think_end in request.output_ids
                     else len(request.output_ids) if any(i["type"] == "reasoning" for i in items) else 0)
        counts = usage([request])
        return {**base, "status": "incomplete" if cut else "completed", "output": items,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": {"input_tokens": counts["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens": counts["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": reasoning},
                          "total_tokens": counts["total_tokens"]}}

    def fitting_requests(self, chat, thinking: bool, tools, truncate: bool) -> tuple:
        """chat_requests; with truncation "auto", as OpenAI does, the oldest input items (never the
        system message, nor the last item) are dropped one by one until the conversation fits."""
        while True:
            try:
                return self.chat_requests(chat, thinking, tools, None)
            except APIError as e:
                older = [i for i, m in enumerate(chat.messages[:-1]) if m.role not in ("system", "developer")]
                if not truncate or e.code != "context_length_exceeded" or not older:
                    raise
                chat.messages = chat.messages[:older[0]] + chat.messages[older[0] + 1:]

    async def events(self, queue, choice: Choice, base: dict, thinking: bool, tools_on: bool, opened: bool,
                     body: ResponsesRequest, http):
        """The typed events of a streamed response, as SSE lines: every item is announced
        (output_item.added), grows by deltas and is closed (output_item.done) before the next one."""
        sequence = 0
        out = Output()
        calls = 0

        def event(kind: str, **fields) -> str:
            nonlocal sequence
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **fields})}\n\n"

        def close() -> list[str]:   # the open reasoning or message item is done
            item, out.open = out.open, None
            if item is None:
                return []
            index, part = len(out.items) - 1, item["content"][0]
            item["status"] = "completed"
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            return [event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], **({"logprobs": []} if kind == "output_text" else {})),
                    event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=item)]

        def grow(kind: str, text: str) -> list[str]:   # text for an item of this kind: open one if need be
            lines = []
            if out.open is None or out.open["type"] != kind:
                lines += close()
                out.open = out.reasoning() if kind == "reasoning" else out.message()
                out.items.append(out.open)
                index, part = len(out.items) - 1, out.open["content"][0]
                lines += [event("response.output_item.added", output_index=index,
                                item={**out.open, "content": []}),
                          event("response.content_part.added", item_id=out.open["id"], output_index=index,
                                content_index=0, part=dict(part))]
            index = len(out.items) - 1
            out.open["content"][0]["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            return lines + [event(name, item_id=out.open["id"], output_index=index, content_index=0, delta=text,
                                  **({"logprobs": []} if kind == "message" else {}))]

        def function_call(call: dict) -> list[str]:
            item = out.function_call(call)
            out.items.append(item)
            index = len(out.items) - 1
            return [event("response.output_item.added", output_index=index,
                          item={**item, "arguments": "", "status": "in_progress"}),
                    event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"]),
                    event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=item["arguments"], name=item["name"]),
                    event("response.output_item.done", output_index=index, item=item)]

        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        pending: dict[int, dict] = {}   # tool calls started, by index (parsers.completed_calls)
        try:
            async with contextlib.aclosing(self.outputs(queue, [choice.request], http)) as outputs:
                async for _, output in outputs:
                    choice.text += output.text
                    choice.finish_reason = output.finish_reason
                    deltas = choice.parser.feed(output.text) + (choice.parser.finish() if output.finished else [])
                    for delta in deltas:
                        for line in (grow("reasoning", delta["reasoning_content"]) if "reasoning_content" in delta
                                     else grow("message", delta["content"]) if delta.get("content") else []):
                            yield line
                        for whole in completed_calls(pending, delta):
                            calls += 1
                            if (body.parallel_tool_calls is False and calls > 1) or \
                                    (body.max_tool_calls and calls > body.max_tool_calls):
                                continue
                            for line in close() + function_call(whole):
                                yield line
        except EngineStopped as e:   # the error, then the response as failed: the last event, as OpenAI ends it
            yield event("error", code="server_error", message=str(e), param=None)
            for item in out.items:
                if item["status"] == "in_progress":   # cut off by the failure
                    item["status"] = "incomplete"
            yield event("response.failed", response={**base, "status": "failed", "output": out.items,
                                                     "error": {"code": "server_error", "message": str(e)}})
            return
        for line in close():
            yield line
        if not out.items:   # nothing at all was written: an empty message, as the whole answer says
            for line in grow("message", "") + close():
                yield line
        response = self.final(base, out.items, choice, calls > 0)
        yield event(f"response.{response['status']}", response=response)
