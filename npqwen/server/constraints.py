"""OpenAI's response_format, vLLM's structured_outputs and tool_choice -> the engine's constraint.

    response_format {"type": "json_object"}                   any JSON object
    response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                              that schema (strict or not)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}   vLLM's field
    tool_choice "required" / {"function": {"name"}}           a <tool_call> whose JSON names one of
                                                              the tools (or that one) with arguments
                                                              valid against its parameters
    tool_choice "auto" with a "strict": true function         free text, but once the model opens
                                                              <tool_call> the call must be valid

Each is one of SamplingParams' constraint fields (json_schema=, regex=, choice=, grammar=);
a tool call is a grammar in llguidance's Lark, written here. The body field a bad constraint is
charged to (`param` of the 400) comes with it.
"""
import json

from ..structured import ConstraintError, closed_objects, grammar_entry, ll_tokenizer, llguidance, with_json_whitespace
from .protocol import APIError, NamedToolChoice

ANY_OBJECT = {"type": "object"}
SO_FIELDS = {"json_": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}


def format_constraint(body) -> tuple[dict, str] | None:
    """(constraint keyword arguments, param) asked for by response_format or structured_outputs; None: free."""
    fmt = getattr(body, "response_format", None)
    so = body.structured_outputs
    asked = []
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format type 'json_schema' needs json_schema: {name, schema}",
                           "response_format.json_schema")
        asked.append(({"json_schema": fmt.json_schema.schema_}, "response_format.json_schema.schema"))
    elif fmt is not None and fmt.json_schema is not None:
        raise APIError(400, f"response_format.json_schema is only read with type 'json_schema', not "
                            f"{fmt.type!r}", "response_format.json_schema")
    elif fmt is not None and fmt.type == "json_object":
        asked.append(({"json_schema": ANY_OBJECT}, "response_format"))
    if so is not None:
        given = [(name, value) for name, value in ((SO_FIELDS[f], getattr(so, f)) for f in SO_FIELDS)
                 if value is not None and value is not False]
        if len(given) > 1:
            raise APIError(400, f"structured_outputs: give one of json, regex, choice, grammar or json_object, not "
                                f"{' and '.join(name for name, _ in given)}", "structured_outputs")
        for name, value in given:
            kind = {"json": "json_schema", "json_object": "json_schema"}.get(name, name)
            asked.append(({kind: ANY_OBJECT if name == "json_object" else value}, f"structured_outputs.{name}"))
    if len(asked) > 1:
        raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    return asked[0] if asked else None


def chat_constraint(body, tokenizer, vocab_size: int, eos_ids) -> tuple[dict, str] | None:
    """(constraint keyword arguments, param) of a chat body: its format, or its tool calls."""
    fmt = format_constraint(body)
    tools_on = bool(body.tools) and body.tool_choice != "none"
    choice = body.tool_choice
    forced = tools_on and (choice == "required" or isinstance(choice, NamedToolChoice))
    lazy = tools_on and not forced and any(t.function.strict for t in body.tools)
    if not (forced or lazy):
        return fmt
    if fmt is not None:
        raise APIError(400, "npqwen constrains either the tool calls (tool_choice 'required', a named function, "
                            "or 'strict' functions) or the answer's format, not both; drop one", fmt[1])
    for i, tool in enumerate(body.tools):   # each schema alone first, so that a bad one is named
        check_schema(tool.function.parameters, f"tools[{i}].function.parameters", tokenizer, vocab_size, eos_ids)
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in body.tools if t.function.name == choice.function.name]
        return {"grammar": tool_call_grammar(tools, many=False, lazy=False)}, "tool_choice"
    return {"grammar": tool_call_grammar(body.tools, many=body.parallel_tool_calls is not False,
                                         lazy=lazy)}, "tools"


def check_schema(schema, param: str, tokenizer, vocab_size: int, eos_ids):
    """A 400 naming `param` when this JSON Schema cannot be used."""
    if schema is None:
        return
    try:
        _, entry = grammar_entry(json_schema=schema)
        error = llguidance().LLMatcher.validate_grammar(json.dumps({"grammars": [entry]}),
                                                        ll_tokenizer(tokenizer, vocab_size, eos_ids))
    except ConstraintError as e:
        raise APIError(400, str(e), param) from None
    if error:
        raise APIError(400, f"{param}: the schema cannot be used: {error}", param)


def call_schema(function, strict: bool) -> dict:
    """The JSON Qwen3 writes inside <tool_call>: {"name": its name, "arguments": valid against its
    parameters (any object when not strict)}, in that order. The parameters' $defs move up to the
    root, where their "#/$defs/..." references point."""
    parameters = dict(closed_objects(function.parameters) or ANY_OBJECT) if strict else dict(ANY_OBJECT)
    defs = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return with_json_whitespace({"type": "object", "properties": {"name": {"const": function.name},
                                                                  "arguments": parameters},
                                 "required": ["name", "arguments"], "additionalProperties": False, **defs})


def tool_call_grammar(tools, many: bool, lazy: bool) -> str:
    """A Lark grammar (llguidance's dialect) for Qwen3's tool calls,

        <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>

    one (`many` False) or several separated by "\\n". `lazy` ("auto"): free text, in which each
    <tool_call> the model opens must be a valid call ("<tool_call>" is a special token, which the
    text's regex never matches, so the grammar takes over exactly there). Forced calls ("required",
    named) check every function's arguments; lazy ones those of "strict" functions only.
    """
    calls = " | ".join(f"fn_{i}" for i in range(len(tools)))
    lines = ["%llguidance {}"]
    if lazy:
        lines += ["start: TEXT (call TEXT)*", r"TEXT: /(.|\n)*/"]
    else:
        lines += ['start: call ("\\n" call)*' if many else "start: call"]
    lines += [f'call: <tool_call> "\\n" ({calls}) "\\n" </tool_call>']
    for i, tool in enumerate(tools):
        strict = not lazy or bool(tool.function.strict)
        lines.append(f"fn_{i}: %json {json.dumps(call_schema(tool.function, strict))}")
    return "\n".join(lines)
