"""The OpenAI API's shapes: request bodies (validated by pydantic), errors, and response pieces.

Bodies are strict: a field npqwen does not know is a 400 that names it (OpenAI's shape, never
FastAPI's 422), and so is a known field with a value npqwen does not implement (logit_bias,
suffix). Nothing that would change the answer is silently ignored;
OpenAI's fields about the service (store, metadata, service_tier, ...: IGNORED) are accepted
and logged once. Beyond OpenAI's fields, the extras that vLLM and SGLang accept: top_k, min_p,
repetition_penalty, chat_template_kwargs.enable_thinking, and vLLM's return_token_ids,
prompt_logprobs, ignore_eos, min_tokens, skip_special_tokens, include_stop_str_in_output,
add_generation_prompt, continue_final_message, structured_outputs (see constraints.py). An int
field takes a whole-number float (2.0). npqwen's own endpoints for the page take an
AttentionRequest and an ExpertsRequest. The Responses API's request is in protocol_responses.py.
"""
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError, WrapValidator

from ..chat_format import ROLES

MAX_CHOICES = 8          # n
MAX_TOP_LOGPROBS = 20    # top_logprobs (chat), logprobs (completions)
MAX_STOPS = 16
MAX_ATTENTION_TOKENS = 2048   # tokens one /v1/npqwen/attention call may rerun
MAX_SALIENCY_TOKENS = 1024    # tokens one /v1/npqwen/saliency call runs a backward pass over (the engine waits)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None, details: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers   # HTTP headers of the answer (a 429's Retry-After, a 405's Allow)
        self.details = details   # Anthropic's error.details (a thread refused), for a client that acts on it

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def whole_number(value):
    """2.0 is an integer to JSON Schema (and to JavaScript clients, which send it so); 2.5 is not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Whole = Annotated[int, BeforeValidator(whole_number)]   # an int field that takes a whole-number float


def whole_numbers(value, handler):
    """Token ids: pydantic's own (fast) strict list of ints; failing that, ints and whole-number floats."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, list) and all(type(v) is int or (type(v) is float and v.is_integer()) for v in value):
            return handler([int(v) for v in value])
        raise


TokenIds = Annotated[list[int], WrapValidator(whole_numbers)]   # token ids: ints, or whole-number floats


class Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool, as OpenAI's server reads them
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An image, audio or file part: recognised so that it can be refused with the reason
    (template_messages), not as "not a valid string"."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "input_file"]


class ToolCallFunction(Strict):
    name: str
    arguments: str | dict                  # OpenAI sends a JSON string; the chat template takes either


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(Strict):
    role: Literal[("developer", *ROLES)]   # the chat template's roles (chat_format.ROLES), and OpenAI's
                                            # "developer", written as "system" (template_messages)
    content: str | list[TextPart | MediaPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None   # an earlier answer's reasoning, sent back
    reasoning: str | None = None
    refusal: str | None = None             # echoed back by clients from earlier answers; always null here
    annotations: list | None = None


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None                # OpenAI pads chunks (size analysis); npqwen adds none


class ChatTemplateKwargs(Strict):
    enable_thinking: bool | None = None                   # None: on (or as reasoning_effort says)


class JSONSchemaFormat(Strict):
    name: str
    description: str | None = None
    schema_: dict | bool = Field(alias="schema")          # "schema" would shadow pydantic's BaseModel.schema
    strict: bool | None = None                            # enforced either way


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's extra field: the answer matches one of these (constraints.py)."""
    json_: dict | bool | str | None = Field(None, alias="json")   # a JSON Schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                            # llguidance's Lark, or GBNF
    json_object: bool | None = None


class Steer(Strict):
    """One steering item: scale * vector added to the residual stream after block `layer` (npqwen/steering.py)."""
    layer: int
    vector: list[float]
    scale: float = 1.0


class FeatureEditItem(Strict):
    """One feature edit: an SAE the server loaded (`npqwen serve --sae NAME=PATH`), a feature, and one of clamp
    (set it to a value), zero (true) or scale (multiply it) (npqwen/features.py)."""
    sae: str
    feature: int
    clamp: float | None = None
    zero: bool | None = None
    scale: float | None = None


class Speculative(Strict):
    """Speculative decoding for this request (npqwen/speculative.py), vLLM's speculative_config names; k is
    num_speculative_tokens."""
    method: Literal["ngram", "mtp"]
    k: Whole | None = Field(None, ge=1, le=64)
    num_speculative_tokens: Whole | None = Field(None, ge=1, le=64)
    prompt_lookup_max: Whole | None = Field(None, ge=1, le=64)
    prompt_lookup_min: Whole | None = Field(None, ge=1, le=64)


class Sampling(Strict):
    """Fields shared by chat and completions."""
    model: str | None = None                              # None: the one model served (as llama.cpp's server)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Whole | None = Field(None, ge=-1)                 # -1 or 0: off (vLLM's -1 accepted)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: Whole | None = None
    stop: str | list[str] | None = Field(None, max_length=MAX_STOPS)
    n: Whole = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None            # only empty: refused otherwise
    user: str | None = None                               # an end-user id for the caller's logs; unused
    return_token_ids: bool = False                        # vLLM's: prompt_token_ids and each choice's token_ids
    # OpenAI's fields about the service, not the answer: accepted, and logged once as ignored (IGNORED)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None                   # npqwen's prefix cache needs no key
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # vLLM's sampling extras (Request fields, see Serving.vllm_options)
    ignore_eos: bool = False                              # go on after eos (to max_tokens)
    stop_token_ids: TokenIds | None = Field(None, max_length=MAX_STOPS)   # vLLM's: these end the answer as eos does
    min_tokens: Whole = Field(0, ge=0)                    # no eos and no stop string before this many tokens
    skip_special_tokens: bool = False                     # leave special tokens (<|im_end|>) out of the text
    include_stop_str_in_output: bool = False              # the stop string that ended the text stays in it
    structured_outputs: StructuredOutputs | None = None   # vLLM's: json, regex, choice or grammar
    steering: list[Steer] | None = None                   # npqwen's: vectors added after blocks, this request only
    feature_edits: list[FeatureEditItem] | None = None    # npqwen's: SAE features clamped, zeroed or scaled
    speculative: Speculative | None = None                # npqwen's: drafts verified a step at a time (same output)

    def sampling(self) -> dict:
        """The body's sampling values as SamplingParams fields (None: the checkpoint's default)."""
        return dict(temperature=self.temperature, top_p=self.top_p, min_p=self.min_p,
                    top_k=None if self.top_k is None else max(self.top_k, 0),
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, stop=self.stop,
                    speculative=None if self.speculative is None else self.speculative.model_dump(exclude_none=True))

    def check_supported(self):
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by npqwen; remove it", "logit_bias", "unsupported")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Whole | None = Field(None, ge=1)
    max_completion_tokens: Whole | None = Field(None, ge=1)   # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: Whole | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None   # Qwen3: on or off
    add_generation_prompt: bool = True                    # vLLM's: end the prompt with "<|im_start|>assistant\n"
    continue_final_message: bool = False                  # vLLM's: go on writing the last (assistant) message
    prompt_logprobs: Whole | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)   # vLLM's: the prompt's tokens scored
    thinking_token_budget: Whole | None = Field(None, ge=0)   # vLLM's: reasoning tokens before "</think>" is forced

    def check_supported(self):
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs in a chat is answered whole (stream: false); /v1/completions "
                                "streams them", "prompt_logprobs", "unsupported")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message goes on writing the last message, so it needs "
                                "add_generation_prompt: false", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, f"continue_final_message needs an assistant message last, not a "
                                f"{self.messages[-1].role!r} one", "continue_final_message")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise APIError(400, f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                    f"among the tools ({', '.join(names)})", "tool_choice")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def prompt_kind(value) -> str:
    """Which of completions' prompt types a value is, from its first element: pydantic then checks
    that one alone. (Left to itself it tries every type, and a list of 4M ids fails list[str] with 4M
    errors first: 2 s of the event loop.)"""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else 0   # an empty list: no ids (prompts() says it is empty)
    return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"


Prompt = Annotated[Annotated[str, Tag("str")] | Annotated[list[str], Tag("list[str]")]
                   | Annotated[TokenIds, Tag("list[int]")] | Annotated[list[TokenIds], Tag("list[list[int]]")],
                   Discriminator(prompt_kind)]


class CompletionRequest(Sampling):
    prompt: Prompt
    max_tokens: Whole | None = Field(16, ge=0)             # OpenAI's default for completions; 0: echo alone
    logprobs: Whole | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False                                     # the prompt first (scored too, with logprobs)
    prompt_logprobs: Whole | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)   # vLLM's: the prompt's tokens scored
    suffix: str | None = None
    best_of: Whole | None = Field(None, ge=1)

    def check_supported(self):
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 asks for no tokens: it is only for echo (the prompt alone, scored "
                                "with logprobs)", "max_tokens")
        if self.suffix:
            raise APIError(400, "suffix (fill in the middle) is not supported by Qwen3 in npqwen", "suffix",
                           "unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by npqwen", "best_of", "unsupported")

    def prompts(self) -> list:
        """One prompt (str or token ids) per entry."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        return list(p)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None                 # vLLM's: what the tokenizer adds to a text (Qwen3: nothing)
    chat_template_kwargs: ChatTemplateKwargs | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: TokenIds


class AttentionRequest(Strict):
    """POST /v1/npqwen/attention: the attention of position `position` of `tokens` over positions
    0 .. position, in every head of `layer` (a forward pass over tokens[:position + 1])."""
    model: str | None = None
    tokens: TokenIds                                     # 1 .. MAX_ATTENTION_TOKENS ids (checked by the server)
    position: Whole | None = None                           # default: the last token
    layer: Whole | None = None                              # default: the first full-attention layer (0 in Qwen3)


IGNORED = ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "verbosity", "user")


class ExpertsRequest(Strict):
    """POST /v1/npqwen/experts: where the router of each Qwen3-MoE layer sent token `position` of
    `tokens` (a forward pass over tokens[:position + 1])."""
    model: str | None = None
    tokens: TokenIds                                     # 1 .. MAX_ATTENTION_TOKENS ids (checked by the server)
    position: Whole | None = None                         # default: the last token


class FeaturesRequest(Strict):
    """POST /v1/npqwen/features: the SAE features of every token of `tokens` (a forward pass over them all),
    the strongest `top` of token `position`, and where in `tokens` each of those fires."""
    model: str | None = None
    tokens: TokenIds                                     # 1 .. MAX_ATTENTION_TOKENS ids (checked by the server)
    position: Whole | None = None                         # default: the last token
    sae: str | None = None                                # an --sae NAME (default: the first)
    top: Whole = Field(8, ge=1, le=64)


def template_messages(messages: list[Message]) -> list[dict]:
    """Messages as the chat template reads them: text parts joined, unset fields left out."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True, exclude={"refusal", "annotations"})
        media = [j for j, part in enumerate(m.content or []) if isinstance(part, MediaPart)]
        if isinstance(m.content, list) and media:
            raise APIError(400, f"messages[{i}].content[{media[0]}] is a part of type {m.content[media[0]].type!r}: "
                                f"this model reads text only (Qwen3 has no vision or audio); send text parts",
                           f"messages[{i}].content[{media[0]}].type", "unsupported")
        if isinstance(m.content, list):
            d["content"] = "".join(part.text for part in m.content)
        d.setdefault("content", "")
        if m.role == "developer":        # OpenAI's newer name for the system role
            d["role"] = "system"
        out.append(d)
    return out


class EmbeddingRequest(Strict):
    """POST /v1/embeddings, OpenAI's shape: `input` a string, a list of strings, token ids or a list of those."""
    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"   # the openai client asks for base64 by default
    dimensions: Whole | None = None                        # keep the first d values (Matryoshka), renormalised
    user: str | None = None                                # an end-user id for the caller's logs; unused

    def inputs(self) -> list:
        """One input (a string or token ids) per entry."""
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        if not x:
            raise APIError(400, "input is empty: send a string or a non-empty list", "input")
        return list(x)


class RerankDocument(Strict):
    text: str


class RerankRequest(Strict):
    """POST /v1/rerank (and /rerank): the shape vLLM, llama.cpp's server, Jina and Cohere share."""
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: Whole | None = None                             # the n best; default: every document
    return_documents: bool = False                         # put each document's text beside its score

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class LoraAdapterRequest(Strict):   # POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's shapes
    lora_name: str = Field(min_length=1)
    lora_path: str | None = Field(None, min_length=1)   # loading: a directory on the server's disk
    lora_int_id: int | None = None                       # vLLM's; not needed
