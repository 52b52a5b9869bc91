"""The shapes of OpenAI's Responses API (serving_responses.py), strict as protocol.py's: an unknown
field is a 400 that names it; the fields about the service are accepted and logged once."""
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .protocol import IGNORED, APIError, FeatureEditItem, Steer, Strict, Whole

RESPONSE_FIELDS_IGNORED = (*IGNORED, "store", "stream_options", "max_tool_calls")
INCLUDES_ACCEPTED = ("reasoning.encrypted_content",)   # reasoning comes back in the clear, in the item itself


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: str


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None   # the reasoning comes whole, not summarised
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(Strict):
    """POST /v1/responses. Input items are checked one by one (to_messages), with their index in `param`."""
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: Whole | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: str | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: Whole | None = Field(None, ge=0, le=20)
    # accepted and ignored (logged once): they change nothing in the answer
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None   # "auto": the oldest input items dropped until it fits
    stream_options: dict | None = None
    max_tool_calls: Whole | None = Field(None, ge=1)
    steering: list[Steer] | None = None   # npqwen's, as in chat and completions
    feature_edits: list[FeatureEditItem] | None = None   # npqwen's, as in chat and completions
    thinking_token_budget: Whole | None = Field(None, ge=0)   # vLLM's: reasoning tokens before "</think>" is forced

    def check_supported(self):
        if self.previous_response_id is not None:
            raise APIError(400, "npqwen keeps no responses, so previous_response_id cannot be looked up: send the "
                                "whole conversation as input items (with store: false)", "previous_response_id",
                           "unsupported")
        if self.background:
            raise APIError(400, "background responses are not served by npqwen: leave background out, or stream",
                           "background", "unsupported")
        for name in self.include or []:
            if name not in INCLUDES_ACCEPTED:
                raise APIError(400, f"include {name!r} is not served by npqwen (it can include only "
                                    f"{', '.join(INCLUDES_ACCEPTED)})", "include", "unsupported")
        if self.top_logprobs:
            raise APIError(400, "logprobs are not served by npqwen's Responses API; /v1/chat/completions has them",
                           "top_logprobs", "unsupported")
