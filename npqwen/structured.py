"""Structured output: an answer that always matches a JSON schema, a regex, a choice or a grammar.

llguidance (the library behind vLLM's "guidance" backend and llama.cpp's grammars) compiles the
constraint into a matcher over the model's vocabulary. Before each draw the matcher gives a
bitmask with one bit per token id (32 to an int32): 1 where the token keeps the text a prefix of
some valid answer. Every other token's logit becomes -inf (sampling.candidates), so whatever the
weights say the draw picks a token that keeps the answer valid. The drawn token advances the
matcher; once the matcher accepts nothing more, the answer is complete and the request ends
(finish_reason "stop", no end-of-sequence token). Where it may end or go on (a regex [0-9]+), the
mask allows end-of-sequence too, and the model chooses.

    constraint = new_constraint(llm.tokenizer, V, eos_ids, json_schema={"type": "object"})   # checked now
    masks.start([constraint])        # a worker thread fills the mask while the forward pass runs
    allowed = masks.allowed(constraint)                  # (V,) bool
    done = constraint.advance(token, position)           # True once the answer is complete

Qwen3's thinking (`thinking=True`): the answer opens with its reasoning, "<think> ... </think>",
which stays free text. The first token is "<think>" (as Qwen3 writes it; unless the prompt already
ends with it), so that the answer is read as reasoning then content; then until the model draws
"</think>" the mask only takes away end-of-sequence (the answer cannot end before its constrained
part). From the next token on the constraint applies, after at most two newlines (Qwen3 writes
"\\n\\n" after "</think>"; they are not part of the content).

The constraint's text is llguidance's grammar format: {"grammars": [entry, ...]}, one entry a
{"json_schema": ...} or a {"lark_grammar": ...} (llguidance's Lark dialect; GBNF is converted).
"""
import json
import re
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .chat_format import THINK_CLOSE, THINK_OPEN
from .errors import NpqwenError

EXTRA = "pip install 'npqwen[structured]'"
KINDS = ("json_schema", "regex", "choice", "grammar")
AFTER_NEWLINES = r"start: /\n{0,2}/ @answer"   # thinking: the constrained answer may follow "\n\n", no more
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"         # flexible JSON: between two tokens (with_json_whitespace)

_tokenizers = weakref.WeakKeyDictionary()       # npqwen Tokenizer -> {(V, eos ids): llguidance.LLTokenizer}
_tokenizers_lock = threading.Lock()


class ConstraintError(NpqwenError):
    """A constraint that cannot be used (bad value, schema, regex or grammar); the server answers 400."""


class ConstraintFailed(NpqwenError):
    """llguidance failed on a running request (a mask it could not fill, a token it refused): the
    engine ends that request with finish_reason "error" and this message, and the others go on."""


def llguidance():
    """The llguidance module, or an error that names the extra to install."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError as e:
        raise ConstraintError(f"structured output (json_schema=, regex=, choice=, grammar=) needs the llguidance "
                              f"package: {EXTRA}") from e
    return llguidance


def grammar_entry(json_schema=None, regex=None, choice=None, grammar=None) -> tuple[str, dict] | None:
    """(kind, llguidance grammar entry) of the one constraint given, or None when none is; the values
    are checked here, the schema, regex or grammar itself when its matcher is made."""
    given = {kind: value for kind, value in zip(KINDS, (json_schema, regex, choice, grammar)) if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError(f"give one constraint, not {' and '.join(given)}")
    (kind, value), = given.items()
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"json_schema is not valid JSON ({e})") from None
        if not isinstance(value, (dict, bool)):
            raise ConstraintError(f"json_schema must be a JSON Schema (a dict, or its JSON text), got "
                                  f"{type(value).__name__} {str(value)[:40]!r}")
        return kind, {"json_schema": with_json_whitespace(closed_objects(value))}
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
            raise ConstraintError(f"choice must be a non-empty list of strings, got {str(value)[:40]!r}")
        bad = next((i for i, c in enumerate(value) if not isinstance(c, str) or not c), None)
        if bad is not None:
            raise ConstraintError(f"choice[{bad}] must be a non-empty string, got {value[bad]!r}")
        return kind, {"lark_grammar": "start: " + " | ".join(json.dumps(c) for c in value)}
    if not isinstance(value, str) or not value:
        raise ConstraintError(f"{kind} must be a non-empty string, got {str(value)[:40]!r}")
    llg = llguidance()
    if kind == "regex":
        return kind, json.loads(llg.LLMatcher.grammar_from_regex(value))["grammars"][0]
    try:   # llguidance's Lark dialect as it is; GBNF (llama.cpp's "rule ::= ...") converted to it
        return kind, {"lark_grammar": llg.grammar_from("grammar", value)}
    except ValueError as e:
        raise ConstraintError(f"the grammar is neither llguidance's Lark nor GBNF: {e}") from None


SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
             "propertyNames", "unevaluatedProperties", "unevaluatedItems")   # keys whose value is a schema
SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """The schema with "additionalProperties": false on each object schema that declares its properties
    and says nothing of other keys. JSON Schema lets such an object hold any other key too, and a
    constrained model (a small one especially) then writes keys of its own, often until max_tokens;
    vLLM's default grammar backend (xgrammar) generates no undeclared key unless the schema allows it
    ("additionalProperties": true or a schema), and its llguidance backend does the same with
    disable_additional_properties, by this same rewrite (llguidance itself has no option for it).
    allOf's members are left open: closing one would refuse the keys its siblings declare."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def with_json_whitespace(schema):
    """The schema with npqwen's whitespace rule for llguidance (its "x-guidance" key; the schema's own
    settings there win). By default compact JSON as json.dumps and Qwen3's chat template write it:
    ", " between items, ": " after a key, no other whitespace (llguidance's non-flexible form). With
    "x-guidance": {"whitespace_flexible": true}, between two JSON tokens nothing, one space, or a
    newline and up to 20 spaces or tabs (JSON_WHITESPACE, llama.cpp's rule). Unbounded whitespace,
    which is valid JSON, lets a weak model (or random weights) write whitespace until max_tokens."""
    if not isinstance(schema, dict):
        return schema
    own = schema.get("x-guidance", {})
    if own.get("whitespace_flexible"):
        rule = {"whitespace_pattern": JSON_WHITESPACE}
    else:
        rule = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {**schema, "x-guidance": {**rule, **own}}


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's view of the vocabulary, from npqwen's own tokenizer.json (no transformers); made
    once per tokenizer (about a second for Qwen3's 151k tokens)."""
    llg = llguidance()
    key = (vocab_size, tuple(eos_ids))
    with _tokenizers_lock:   # the server makes requests in several threads: build it once
        made = _tokenizers.setdefault(tokenizer, {})
        if key not in made:
            made[key] = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                        eos_token=list(eos_ids) or None)
        return made[key]


@dataclass(eq=False)
class Constraint:
    """One request's constraint: its llguidance matcher, and where in the answer it starts to apply."""
    matcher: object                  # llguidance.LLMatcher
    kind: str                        # "json_schema", "regex", "choice" or "grammar"
    vocab_size: int
    eos_ids: tuple
    think_end: int | None = None     # with thinking: the token that ends the free reasoning ("</think>")
    think_open: int | None = None    # with thinking: the token the answer must open with ("<think>"), until drawn
    start: int | None = None         # position in the answer of the first constrained token; None while reasoning
    consumed: int = 0                # answer tokens the matcher has taken (checked by Engine.check)

    @property
    def reasoning(self) -> bool:
        return self.start is None

    def free_mask(self) -> np.ndarray:
        """While reasoning: "<think>" first, then every token but end-of-sequence. (V,) bool"""
        if self.think_open is not None:
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[self.think_open] = True
            return allowed
        allowed = np.ones(self.vocab_size, dtype=bool)
        allowed[list(self.eos_ids)] = False
        return allowed

    def advance(self, token: int, position: int) -> bool:
        """Take the answer's token at `position` (not end-of-sequence); True once the answer is complete."""
        if self.start is None:
            if token == self.think_open:
                self.think_open = None
            elif token == self.think_end:
                self.start = position + 1
            return False
        if not self.matcher.consume_token(token):   # never, when the token was drawn under the mask
            raise ConstraintFailed(f"the {self.kind} constraint refused token {token}: "
                                   f"{one_line(self.matcher.get_error(), self.kind)}")
        self.consumed += 1
        return self.matcher.is_stopped()

    def check(self, answer_length: int):
        """The matcher has taken exactly the answer's tokens after the reasoning, each once."""
        taken = 0 if self.start is None else answer_length - self.start
        if self.consumed != taken:
            raise NpqwenError(f"the {self.kind} matcher took {self.consumed} tokens, but the answer has {taken} "
                              f"constrained ones")


def new_constraint(tokenizer, vocab_size: int, eos_ids, json_schema=None, regex=None, choice=None, grammar=None,
                   thinking: bool = False, prompt_ids=()) -> Constraint | None:
    """The Constraint of these arguments (None without one), its matcher made and checked now; see
    build_constraint. The engine's requests take theirs from SamplingParams, which checks the values."""
    return build_constraint(tokenizer, vocab_size, eos_ids, grammar_entry(json_schema, regex, choice, grammar),
                            thinking, prompt_ids)


def build_constraint(tokenizer, vocab_size: int, eos_ids, given: tuple[str, dict] | None, thinking: bool = False,
                     prompt_ids=()) -> Constraint | None:
    """A request's Constraint from grammar_entry's (kind, entry) (None without one), its matcher made and
    checked now: a bad schema, regex or grammar is a ConstraintError naming the problem. `prompt_ids`
    tell whether the prompt itself opened the reasoning (ends with "<think>") or closed it ("</think>")."""
    if given is None:
        return None
    kind, entry = given
    if tokenizer is None:
        raise ConstraintError(f"a {kind} constraint needs the checkpoint's tokenizer (tokenizer.json)")
    llg = llguidance()
    think_end = tokenizer.token_to_id(THINK_CLOSE) if thinking else None
    grammars = [entry] if think_end is None else [{"lark_grammar": AFTER_NEWLINES}, {**entry, "name": "answer"}]
    matcher = llg.LLMatcher(ll_tokenizer(tokenizer, vocab_size, eos_ids), json.dumps({"grammars": grammars}),
                            log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"the {kind} constraint cannot be used: {one_line(matcher.get_error(), kind)}")
    tail = tokenizer.decode(list(prompt_ids)[-4:]).rstrip("\n") if think_end is not None else ""
    # the prompt may have opened the reasoning already (then the answer need not), or even closed it
    opened = think_end is None or tail.endswith(THINK_OPEN)
    think_open = None if opened else tokenizer.token_to_id(THINK_OPEN)
    start = 0 if think_end is None or tail.endswith(THINK_CLOSE) else None
    return Constraint(matcher, kind, vocab_size, tuple(eos_ids), think_end, think_open, start)


def one_line(error: str, kind: str) -> str:
    """llguidance's message on one line: its first line and its "error: ..." lines, not its picture of
    the regex with a caret, nor the line of Lark it compiled a regex into (nor that position, "at 1(8)")."""
    lines = error.strip().splitlines()
    text = " ".join([lines[0]] + [line.strip() for line in lines[1:] if line.strip().startswith("error:")])
    text = text.replace(": error: ", ": ")
    return re.sub(r"^at \d+\(\d+\): ", "", text) if kind == "regex" else text


class Masks:
    """The next-token masks of one step's constrained rows, filled by llguidance in a worker thread.

    Engine.step calls start() just before the forward pass and allowed() after it, when it samples:
    a mask depends only on the tokens drawn in earlier steps, so it is computed while the model
    computes the logits it will be applied to. llguidance's batched fill releases the GIL, so the
    two really run at once (on the CPU NumPy's matrix products release it too).
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.pool = self.executor = None      # the worker thread and llguidance's executor, made on first use
        self.job: Future | None = None        # the fill running now, if any
        self.masks: np.ndarray | None = None  # (B, V) bool: the last fill's result
        self.failure: Exception | None = None # what the last fill raised instead
        self.rows: dict[int, int] = {}        # id(constraint) -> its row in the masks

    def start(self, constraints: list[Constraint]):
        """Begin filling the masks of these constraints' next tokens (those past their reasoning)."""
        self.wait()                           # the matchers are never read by two threads at once
        active = [c for c in constraints if not c.reasoning]
        self.rows = {id(c): i for i, c in enumerate(active)}
        self.masks = self.failure = None
        if not active:
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="npqwen-masks")
            self.executor = llguidance().LLExecutor()
        self.job = self.pool.submit(self.fill, [c.matcher for c in active])

    def fill(self, matchers) -> np.ndarray:
        """On the worker thread: the masks as (B, V) bool, one row per matcher."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

        bitmask = allocate_token_bitmask(len(matchers), self.vocab_size)           # (B, ceil(V / 32)) int32
        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")     # bit j of word w: token 32w + j
        return bits[:, :self.vocab_size].view(bool)

    def wait(self):
        job, self.job = self.job, None
        if job is not None:
            try:
                self.masks = job.result()
            except Exception as e:   # this step's constrained requests end (allowed raises), the free ones go on
                self.failure = e

    def allowed(self, constraint: Constraint | None) -> np.ndarray | None:
        """The tokens this constraint allows next, (V,) bool; None for a free request."""
        if constraint is None:
            return None
        if constraint.reasoning:
            return constraint.free_mask()
        self.wait()
        if self.failure is not None:
            raise ConstraintFailed(f"llguidance could not fill the {constraint.kind} constraint's next-token mask: "
                                   f"{self.failure}")
        if constraint.matcher.is_error():   # its mask would allow only end-of-sequence: an invalid answer
            raise ConstraintFailed(f"the {constraint.kind} constraint failed: "
                                   f"{one_line(constraint.matcher.get_error(), constraint.kind)}")
        allowed = self.masks[self.rows[id(constraint)]]
        if not allowed.any():
            raise ConstraintFailed(f"the {constraint.kind} constraint allows no next token")
        return allowed
