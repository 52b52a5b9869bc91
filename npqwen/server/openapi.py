"""What /openapi.json says beyond pydantic's schema of the bodies, so that it tells the truth about
what the server refuses: bounds in JSON Schema's words, and the limits the handlers check (a
prompt that is not empty, documents to rerank, token ids in the vocabulary, fields that need
another field). A body the schema allows is served; one it refuses is a 400 (schemathesis checks
both ways: tests/test_server_openapi.py).
"""
from .protocol import MAX_CHOICES
from .protocol_responses import INCLUDES_ACCEPTED

BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}
TOKEN_ID_FIELDS = (("DetokenizeRequest", "tokens"), ("AttentionRequest", "tokens"), ("ExpertsRequest", "tokens"),
                   ("CompletionRequest", "prompt"), ("EmbeddingRequest", "input"),
                   ("ChatCompletionRequest", "stop_token_ids"), ("CompletionRequest", "stop_token_ids"))
# (/detokenize is not here: as vLLM's, it decodes no tokens to "")
NOT_EMPTY = (("CompletionRequest", "prompt"), ("EmbeddingRequest", "input"), ("RerankRequest", "documents"),
             ("AttentionRequest", "tokens"), ("ExpertsRequest", "tokens"))


def json_schema_bounds(node):
    """Pydantic writes the bounds of an optional constrained int (`Whole | None = Field(ge=1)`) as
    its own keys, ge and le, which JSON Schema does not know: write minimum and maximum (in place)."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for old, new in BOUNDS.items():
                if old in node:
                    node[new] = node.pop(old)
        for value in node.values():
            json_schema_bounds(value)
    elif isinstance(node, list):
        for value in node:
            json_schema_bounds(value)


def alternatives(schema: dict) -> list[dict]:
    """The schemas a value may match: the branches of an anyOf / oneOf, or the schema itself."""
    return schema.get("anyOf") or schema.get("oneOf") or [schema]


def not_empty(schema: dict, strings: bool = True):
    """Every string and every list in the schema (its items too) at least one long."""
    for branch in alternatives(schema):
        if branch.get("type") == "string" and strings:
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1
            not_empty(branch["items"], strings)


def token_ids(schema: dict, vocab_size: int):
    """Every integer in the schema (its lists' items too) a token id: 0 .. V - 1."""
    for branch in alternatives(schema):
        if branch.get("type") == "integer":
            branch.update(minimum=0, maximum=vocab_size - 1)
        elif branch.get("type") == "array":
            token_ids(branch["items"], vocab_size)


def needs(field: str, then: dict) -> dict:
    """JSON Schema's "if `field` is given (not null), then `then`"."""
    return {"if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}}, "then": then}


def without_media(node):
    """Image, audio and file parts are in pydantic's schema only to be refused with the reason: not here."""
    if isinstance(node, dict):
        for key in ("anyOf", "oneOf"):
            if key in node:
                node[key] = [b for b in node[key] if b.get("$ref") != "#/components/schemas/MediaPart"]
        for value in node.values():
            without_media(value)
    elif isinstance(node, list):
        for value in node:
            without_media(value)


# the blocks each role of a Messages conversation may hold (serving_messages.to_messages refuses the others)
BLOCKS_OF_ROLE = {"user": ("TextBlock", "ToolResultBlock"), "system": ("TextBlock",),
                  "assistant": ("TextBlock", "ThinkingBlock", "RedactedThinkingBlock", "ToolUseBlock")}


def messages_api(components: dict):
    """The Messages API's limits: each role's blocks, no image or document anywhere (MediaBlock is in
    pydantic's schema only to be refused with the reason), no server tools, no thread."""
    if "InputMessage" not in components:
        return
    components.pop("MediaBlock", None)
    components.pop("ServerTool", None)
    ref = "#/components/schemas/"
    components["InputMessage"] = {"title": "InputMessage", "oneOf": [{
        "type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
            "role": {"const": role}, "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                "oneOf": [{"$ref": ref + block} for block in blocks]}}]}}} for role, blocks in BLOCKS_OF_ROLE.items()]}
    result = components["ToolResultBlock"]["properties"]["content"]
    result["anyOf"] = [{"type": "string"}, {"type": "array", "items": {"$ref": ref + "TextBlock"}}, {"type": "null"}]
    for name in ("CountTokensRequest", "MessagesRequest"):
        properties = components.get(name, {}).get("properties", {})
        if "tools" in properties:
            properties["tools"] = {"anyOf": [{"type": "array", "items": {"$ref": ref + "CustomTool"}},
                                             {"type": "null"}]}
        if "thread" in properties:
            properties["thread"] = {"anyOf": [{"const": False}, {"type": "null"}]}


def tell_the_truth(schema: dict, config=None, empty_input: bool = False, rerank: bool = True):
    """The limits the handlers check, written into the schema (in place). `empty_input`: the embedding
    tokenizer adds a token of its own, so an empty input is served; `rerank`: the model has the
    reranker's "yes" and "no" tokens (else the rerank routes are left out: they could answer only 400s)."""
    components = schema["components"]["schemas"]
    vocab_size = None if config is None else config.vocab_size
    if not rerank:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            schema["paths"].pop(path, None)
    json_schema_bounds(components)
    components.pop("MediaPart", None)
    without_media(components)

    def prop(name, field):
        return components.get(name, {}).get("properties", {}).get(field)

    for name, field in NOT_EMPTY:
        if prop(name, field) is not None:
            not_empty(prop(name, field), strings=not (name == "EmbeddingRequest" and empty_input))
    if prop("RerankRequest", "documents") is not None:
        prop("RerankRequest", "documents")["maxItems"] = 2048
    if vocab_size is not None:
        for name, field in TOKEN_ID_FIELDS:
            if prop(name, field) is not None:
                token_ids(prop(name, field), vocab_size)
    if config is not None:   # the model's sizes: embeddings' dimensions, the probes' layers and positions
        sizes = (("EmbeddingRequest", "dimensions", 1, config.hidden_size),
                 ("AttentionRequest", "layer", 0, config.num_hidden_layers - 1),
                 ("AttentionRequest", "position", 0, None), ("ExpertsRequest", "position", 0, None))
        for name, field, low, high in sizes:
            for branch in alternatives(prop(name, field) or {}):
                if branch.get("type") == "integer":
                    branch.update(minimum=low, **({} if high is None else {"maximum": high}))
    outputs = components.get("StructuredOutputs", {}).get("properties", {})
    if "json" in outputs:   # a schema; its JSON text is taken too, but a string is no schema
        outputs["json"] = {"anyOf": [{"type": "object"}, {"type": "boolean"}, {"type": "null"}]}
    tokenize = components.get("TokenizeRequest")
    if tokenize is not None:   # a prompt or messages, not both
        tokenize["oneOf"] = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"},
                                                                    "messages": {"type": "null"}}},
                             {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1},
                                                                      "prompt": {"type": "null"}}}]
    responses = components.get("ResponsesRequest", {}).get("properties")
    if responses is not None:   # what the Responses API refuses (ResponsesRequest.check_supported)
        responses["top_logprobs"] = {"anyOf": [{"type": "integer", "const": 0}, {"type": "null"}]}
        responses["previous_response_id"] = {"type": "null"}
        responses["background"] = {"anyOf": [{"const": False}, {"type": "null"}]}
        responses["include"] = {"anyOf": [{"type": "array", "items": {"enum": list(INCLUDES_ACCEPTED)}},
                                          {"type": "null"}]}
    if responses is not None:   # no items: nothing to answer (a string may be empty: it is one user message)
        for branch in alternatives(responses["input"]):
            if branch.get("type") == "array":
                branch["minItems"] = 1
    completion = components.get("CompletionRequest")
    if completion is not None:   # best_of only as n (CompletionRequest.check_supported): n's values spelled out
        completion["allOf"] = completion.get("allOf", []) + [{"anyOf": [
            {"not": {"required": ["best_of"]}}, {"properties": {"best_of": {"type": "null"}}},
            {"not": {"required": ["n"]}, "properties": {"best_of": {"const": 1}}},
            *({"required": ["n"], "properties": {"n": {"const": k}, "best_of": {"const": k}}}
              for k in range(1, MAX_CHOICES + 1))]}]
    messages_api(components)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        body = components.get(name)
        if body is None:
            continue
        rules = [needs("stream_options", {"required": ["stream"], "properties": {"stream": {"const": True}}})]
        body["properties"]["logit_bias"] = {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]}
        if name == "ChatCompletionRequest":
            rules.append(needs("top_logprobs", {"required": ["logprobs"],
                                                      "properties": {"logprobs": {"const": True}}}))
            rules.append(needs("tool_choice", {"anyOf": [
                {"properties": {"tool_choice": {"const": "none"}}}, {"required": ["tools"], "properties": {
                    "tools": {"type": "array", "minItems": 1}}}]}))
        body["allOf"] = body.get("allOf", []) + rules
