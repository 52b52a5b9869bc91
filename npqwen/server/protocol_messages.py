"""Anthropic's Messages API shapes (POST /v1/messages, /v1/messages/count_tokens) and its errors.

Strict like the OpenAI shapes: a field npqwen does not know is a 400 naming it. `cache_control`
is accepted on every block, tool and the body: the prefix cache reuses any repeated prefix
anyway. Images, documents and server tools are recognised so that they can be refused with
the reason (serving_messages.to_chat_request).
"""
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .protocol import MAX_STOPS, APIError, Strict, Whole

# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}

ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string", "enum": sorted(set(ERROR_TYPES.values()))}, "message": {"type": "string"},
        "details": {"type": "object"}}}}}


def anthropic_error(e: APIError) -> tuple[int, dict]:
    """(status, body) of an error in Anthropic's shape: {"type": "error", "error": {"type", "message"}};
    a server shutting down (503) is Anthropic's 529 overloaded_error, which its clients retry."""
    status = 529 if e.status == 503 else e.status
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
    details = {"details": e.details} if e.details else {}
    return status, {"type": "error", "error": {"type": kind, "message": message, **details}}


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None                          # echoed back by clients; npqwen cites nothing


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None                           # npqwen signs nothing: sent back, it is not checked
    cache_control: dict | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class MediaBlock(BaseModel):
    """An image or a document: recognised so that it is refused with the reason (this server reads text)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "container_upload"]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None


Block = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | MediaBlock,
                  Field(discriminator="type")]


class InputMessage(Strict):
    # "system": Claude Code (for a model it does not know as Claude) and the SDK's types put system
    # entries among the messages; read where they stand, as the chat template reads a later system message
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class CustomTool(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict                                     # a JSON Schema ("$schema" and all)
    type: Literal["custom"] | None = None
    cache_control: dict | None = None
    strict: bool | None = None                             # forced calls are checked against the schema either way
    input_examples: list[dict] | None = None               # shown to the model after the description (tool_text)
    eager_input_streaming: bool | None = None              # a call's input is streamed whole once it is complete
    defer_loading: bool | None = None                      # no tool search here: the tool is shown from the start
    allowed_callers: list[str] | None = None               # only "direct" calls happen here (no code execution)


class ServerTool(BaseModel):
    """Anthropic's server tools (web_search_..., bash_..., code_execution_...): refused with their name."""
    model_config = ConfigDict(extra="allow")
    type: str


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None                                # the tool, with type "tool"
    disable_parallel_tool_use: bool | None = None          # at most one tool call


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Whole | None = Field(None, ge=1)        # with "enabled": the reasoning's most tokens
    display: Literal["summarized", "omitted"] | None = None


class JSONOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class Metadata(Strict):
    user_id: str | None = None                             # Claude Code's session id; unused


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: what makes the prompt, so its count is the one /v1/messages reads."""
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool | ServerTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None          # the structured-outputs beta's name for output_config.format
    context_management: dict | None = None                 # a beta's field: nothing is cleared here
    thread: dict | bool | None = None                      # refused with Anthropic's thread_unsupported_request


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""
    max_tokens: Whole = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Whole | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    # about the service, not the answer: accepted and ignored
    service_tier: str | None = None
    cache_control: dict | None = None                      # the prefix cache needs no marks

