"""Qwen3's tokenizer: byte-level BPE from tokenizer.json (the `tokenizers` library) and the
checkpoint's own jinja chat template from tokenizer_config.json, rendered as transformers does.
"""
import json
import unicodedata
from datetime import datetime
from pathlib import Path

from .chat_format import check_roles
from .errors import NpqwenError


class Tokenizer:
    """encode / decode / apply_chat_template / stream_decoder over a `tokenizers.Tokenizer`."""

    def __init__(self, backend, chat_template: str | None = None, special_tokens: dict | None = None):
        self.backend = backend                    # tokenizers.Tokenizer
        self.chat_template = chat_template        # jinja source, or None
        self.special_tokens = special_tokens or {}   # e.g. {"eos_token": "<|im_end|>", "pad_token": ...}
        self._template = None
        self._byte_of_char = self._added = None   # for token_bytes, made on first use
        self._longest_token = None                # for fewest_tokens, found on first use

    @classmethod
    def from_dir(cls, directory) -> "Tokenizer":
        """Read tokenizer.json (required) and tokenizer_config.json (chat template, optional)."""
        from tokenizers import Tokenizer as Backend

        directory = Path(directory)
        try:
            backend = Backend.from_file(str(directory / "tokenizer.json"))
        except Exception as e:   # tokenizers raises a bare Exception on malformed files
            raise NpqwenError(f"{directory / 'tokenizer.json'}: cannot be read as a tokenizer ({e})") from e
        config_file = directory / "tokenizer_config.json"
        config = {}
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise NpqwenError(f"{config_file}: not valid JSON ({e})") from e
        template = config.get("chat_template")
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        special = {k: _token_text(v) for k, v in config.items()
                   if k.endswith("_token") and _token_text(v) is not None}
        return cls(backend, template, special)

    def save(self, directory):
        """Write tokenizer.json and tokenizer_config.json (with the chat template)."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {**self.special_tokens, "chat_template": self.chat_template}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (<|im_start|>) become their ids.
        `add_special_tokens` adds what the tokenizer's post-processor adds (for Qwen3: nothing;
        Qwen3-Embedding's appends <|endoftext|>)."""
        if not isinstance(text, str):
            raise NpqwenError(f"encode expects a str, got {type(text).__name__}")
        try:
            # encode_batch, not encode: it lets go of the GIL while it works, so a long text
            # tokenized in one thread does not stop every other thread for seconds
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as e:   # e.g. lone surrogates, which are not valid UTF-8
            at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if at is not None:   # said in npqwen's words, not the library's ("TextEncodeInput must be ...")
                raise NpqwenError(f"cannot tokenize the text: it is not valid Unicode: character {at} is "
                                  f"U+{ord(text[at]):04X}, half of a UTF-16 surrogate pair without its other half "
                                  f"(a lone \\u{ord(text[at]):04x} escape in JSON?), which is no character; send "
                                  f"valid Unicode") from None
            raise NpqwenError(f"cannot tokenize the text: it is not valid Unicode ({e})") from e

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that do not form complete UTF-8 characters become U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), found without tokenizing (a 15 MB prompt takes seconds
        and GBs to tokenize): the text's UTF-8 bytes over the most bytes one token stands for. It
        holds for a byte-level BPE (Qwen3's), whose tokens are runs of the text's bytes after
        normalization; NFC can shrink text, by at most 3x (three 3-byte Hangul jamo into one
        3-byte syllable), so text that NFC would change counts a third. Another kind of
        tokenizer, which might drop bytes, gives no bound (0)."""
        if self._longest_token is None:
            self._longest_token = self._most_bytes_per_token() if self._keeps_every_byte() else 0
        if not self._longest_token:
            return 0
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))   # isascii: no copy
        if self.backend.normalizer is not None and not unicodedata.is_normalized("NFC", text):
            size //= 3
        return size // self._longest_token

    def _keeps_every_byte(self) -> bool:
        """No normalizer or NFC, and a byte-level pre-tokenizer, maybe after regex splits that keep
        what they match (Qwen3's): then the tokens cover every byte of the text."""
        normalizer, pre = self.backend.normalizer, self.backend.pre_tokenizer
        normalizer = json.loads(normalizer.__getstate__()) if normalizer is not None else None
        pre = json.loads(pre.__getstate__()) if pre is not None else {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        return ((normalizer is None or normalizer.get("type") == "NFC")
                and any(p.get("type") == "ByteLevel" for p in parts)
                and all(p.get("type") == "ByteLevel" or (p.get("type") == "Split" and p.get("behavior") == "Isolated")
                        for p in parts))

    def _most_bytes_per_token(self) -> int:
        """A vocabulary entry of a byte-level BPE writes each byte as one character; an added token
        is its text."""
        added = [t.content for t in self.backend.get_added_tokens_decoder().values()]
        return max(max(map(len, self.backend.get_vocab(with_added_tokens=False))),
                   max((len(t.encode("utf-8")) for t in added), default=0))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE entry writes each byte as one character;
        an added token such as <think> is its UTF-8 text); a piece of a character is not valid UTF-8."""
        text = self.backend.id_to_token(int(token_id)) or ""
        if self._byte_of_char is None:
            self._byte_of_char = {c: b for b, c in bytes_to_unicode().items()}
            self._added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        if text in self._added or any(c not in self._byte_of_char for c in text):
            return text.encode("utf-8")
        return bytes(self._byte_of_char[c] for c in text)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt string, exactly as transformers' apply_chat_template(..., tokenize=False)."""
        if self.chat_template is None:
            raise NpqwenError("this tokenizer has no chat template (tokenizer_config.json 'chat_template'); "
                              "use a raw prompt instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise NpqwenError("messages must be a list of {'role': ..., 'content': ...} dicts")
        check_roles(messages)
        if self._template is None:
            self._template = _compile(self.chat_template)
        import jinja2

        try:
            return self._template.render(messages=_with_reasoning_aliases(messages), tools=tools,
                                         documents=None, add_generation_prompt=add_generation_prompt,
                                         enable_thinking=enable_thinking, **self.special_tokens, **kwargs)
        except jinja2.TemplateError as e:
            raise NpqwenError(f"the chat template rejected these messages: {e}") from e


class StreamDecoder:
    """Token ids in, text pieces out; a piece never ends inside a multi-byte UTF-8 character.

    Chinese characters and emoji often span several byte-level tokens: each token's bytes go through
    an incremental UTF-8 decoder, which holds back the start of a character until its last byte and
    writes U+FFFD as soon as bytes cannot become a character (a stray continuation byte, a lead byte
    followed by a byte that does not continue it), so text keeps flowing whatever the model writes.
    `finish()` returns what is left, so the pieces always concatenate to decode(all ids). A tokenizer
    that is not byte-level uses the `tokenizers` DecodeStream instead.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        import codecs

        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""   # emitted so far
        decoder = tokenizer.backend.decoder
        if decoder is not None and json.loads(decoder.__getstate__()).get("type") == "ByteLevel":
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._skipped = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items()
                             if t.special} if skip_special_tokens else set()
        else:
            from tokenizers.decoders import DecodeStream

            self._utf8, self._stream = None, DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        if self._utf8 is None:
            piece = self._stream.step(self.tokenizer.backend, int(token_id)) or ""
        elif int(token_id) in self._skipped:
            piece = ""
        else:
            piece = self._utf8.decode(self.tokenizer.token_bytes(token_id))
        self.text += piece
        return piece

    def finish(self) -> str:
        held = self._utf8.decode(b"", final=True) if self._utf8 is not None else ""   # an unfinished character
        self.text += held
        full = self.tokenizer.decode(self.ids, self.skip)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return held + rest


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_text(value):
    """tokenizer_config.json writes special tokens as "<|im_end|>" or {"content": "<|im_end|>", ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _with_reasoning_aliases(messages):
    """As transformers: a message's reasoning given as `thinking` or `reasoning` is also `reasoning_content`."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None),
                         None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


def _compile(source: str):
    """A sandboxed jinja environment configured like transformers' chat-template renderer."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Not jinja's own tojson, which escapes HTML characters.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise NpqwenError(f"the chat template in tokenizer_config.json does not parse: {e}") from e
