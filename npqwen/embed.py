"""Embeddings: a text -> one vector, computed as sentence-transformers computes it for Qwen3-Embedding.

    vectors = llm.embed(["The capital of China is Beijing.", "Gravity is a force."])   # (2, D) float32
    queries = llm.embed(["What is the capital of China?"], instruction="Given a web search query, "
                        "retrieve relevant passages that answer the query")             # Instruct: ...\\nQuery:...
    scores = queries @ vectors.T                                                        # cosines: unit vectors

Why the last token: in a causal model position t attends to positions 0 .. t only, so the last
position is the one whose hidden state has read the whole text. Qwen3-Embedding is trained that
way: its tokenizer appends <|endoftext|>, and the final-norm hidden state there, L2-normalised, is
the text's embedding ("last-token pooling"). Any other Qwen3 checkpoint embeds the same way (its
last token's final-norm state, not normalised unless asked), e.g. a teacher's states for distillation.

What a checkpoint says about it lives in sentence-transformers' files, in the hub's older format
or the current one (both are read):
    modules.json                       the modules in order: Transformer, Pooling, Normalize
    1_Pooling/config.json              "pooling_mode": "lasttoken" (current), or "pooling_mode_lasttoken": true
    config_sentence_transformers.json  "prompts": {"query": "Instruct: ...\\nQuery:", "document": ""}
    sentence_bert_config.json          "max_seq_length", "do_lower_case" (older); "modality_config" (current)
Without them: last-token pooling, no normalisation, no prompts. The current format may list a
"message" modality (sentence-transformers 5+ adds it when the tokenizer has a chat template): then
each text is a user message rendered through the chat template, the prompt a system message before it.

The engine runs each text as a prefill-only request (npqwen/engine/prefill_only.py): chunks of
many texts are packed into one step without padding, and the model returns the final-norm states
of only the positions the pooling reads (`pooled_positions`), which `pool_chunk` folds into one
vector per text. `dimensions=d` keeps the first d values (Matryoshka) before the normalisation.
"""
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checks import check_token_ids, is_integer
from .errors import NpqwenError

POOLING_MODES = ("lasttoken", "mean", "cls")   # what npqwen pools; sentence-transformers has max, weightedmean too
# sentence-transformers' older 1_Pooling/config.json: one boolean per mode
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
MODULES_RUN = ("Transformer", "Pooling", "Normalize", "LogitScore")   # the last names a reranker's yes/no tokens


class InputTooLong(NpqwenError):
    """An input with more tokens than the model embeds (the server answers it as context_length_exceeded)."""


def query_prompt(instruction: str) -> str:
    """Qwen3-Embedding's query form (its model card): the text follows "Query:" without a space."""
    return f"Instruct: {instruction}\nQuery:"


@dataclass(frozen=True)
class EmbeddingConfig:
    """How a checkpoint turns a text into a vector: its sentence-transformers files, or the defaults."""
    pooling: str = "lasttoken"            # "lasttoken", "mean" or "cls" (1_Pooling/config.json)
    normalize: bool = False               # a Normalize module follows: unit-length vectors
    prompts: dict = field(default_factory=dict)   # prompt name -> text put before the input
    default_prompt_name: str | None = None        # the prompt used when none is named
    max_seq_length: int | None = None     # longer inputs are refused (sentence-transformers would cut them)
    do_lower_case: bool = False           # the text is lowercased before tokenizing
    chat_template: dict | None = None     # "message" modality: the chat template's arguments; None: plain text
    model_type: str | None = None         # "SentenceTransformer" or "CrossEncoder" (config_sentence_transformers)
    yes_no_ids: tuple | None = None       # a CrossEncoder's LogitScore: (true_token_id, false_token_id)
    problem: str | None = None            # why these files cannot be followed; raised when embedding

    @property
    def is_embedding_model(self) -> bool:
        return self.model_type == "SentenceTransformer"


def read_sentence_transformers(path) -> EmbeddingConfig:
    """The sentence-transformers files of a checkpoint directory (None: the defaults). A file npqwen
    cannot follow does not stop the checkpoint from loading: `problem` says why, and embed raises it."""
    if path is None or not (Path(path) / "modules.json").is_file():
        return EmbeddingConfig()
    path = Path(path)
    try:
        return _read_modules(path)
    except NpqwenError as e:
        return EmbeddingConfig(model_type="SentenceTransformer", problem=str(e))


def _read_json(file: Path, default=None):
    if not file.is_file():
        return default
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise NpqwenError(f"{file}: not valid JSON ({str(e)[:200]})") from None


def _read_modules(path: Path) -> EmbeddingConfig:
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise NpqwenError(f"{path / 'modules.json'}: expected a list of {{\"type\", \"path\"}} objects")
    found = {}
    for m in modules:
        kind = m["type"].rsplit(".", 1)[-1]    # sentence_transformers.models.Pooling (older) or ...pooling.Pooling
        if kind not in MODULES_RUN:
            raise NpqwenError(f"{path / 'modules.json'}: a {kind} module ({m['type']}) follows the model; npqwen "
                              f"runs {', '.join(MODULES_RUN[:3])} only, so it cannot embed as this checkpoint says")
        if kind == "Transformer" and m.get("path", "") not in ("", "."):
            raise NpqwenError(f"{path / 'modules.json'}: the Transformer lives in {m.get('path')!r}; npqwen reads "
                              f"the weights of the checkpoint directory itself")
        found[kind] = path / str(m.get("path", ""))
    settings = _read_json(path / "config_sentence_transformers.json", {})
    bert = _read_json(path / "sentence_bert_config.json", {})
    if not isinstance(settings, dict) or not isinstance(bert, dict):
        raise NpqwenError(f"{path}: config_sentence_transformers.json and sentence_bert_config.json must be objects")
    prompts = settings.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, (str, type(None)))
                                                for k, v in prompts.items()):
        raise NpqwenError(f"{path / 'config_sentence_transformers.json'}: prompts must map names to strings")
    prompts = {k: v or "" for k, v in prompts.items()}
    default = settings.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise NpqwenError(f"{path / 'config_sentence_transformers.json'}: default_prompt_name {default!r} is not "
                          f"one of the prompts {sorted(prompts)}")
    limit = bert.get("max_seq_length")
    modalities = bert.get("modality_config") or {"text": {}}   # absent in the older format: text only
    kwargs = (bert.get("processing_kwargs") or {}).get("chat_template") or {}
    chat_template = dict(kwargs) if isinstance(modalities, dict) and "message" in modalities else None
    model_type = settings.get("model_type") or ("CrossEncoder" if "LogitScore" in found else "SentenceTransformer")
    pooling = _read_pooling(found["Pooling"]) if "Pooling" in found else "lasttoken"
    return EmbeddingConfig(pooling=pooling, normalize="Normalize" in found, prompts=prompts,
                           default_prompt_name=default, max_seq_length=limit if is_integer(limit) else None,
                           do_lower_case=bert.get("do_lower_case") is True, chat_template=chat_template,
                           model_type=model_type,
                           yes_no_ids=_read_logit_score(found["LogitScore"]) if "LogitScore" in found else None)


def _read_pooling(folder: Path) -> str:
    """The one pooling mode of 1_Pooling/config.json, current ("pooling_mode") or older (booleans)."""
    config = _read_json(folder / "config.json", {})
    if not isinstance(config, dict):
        raise NpqwenError(f"{folder / 'config.json'}: expected a JSON object")
    modes = config.get("pooling_mode")
    if modes is None:   # older: a boolean per mode; none set means mean, as sentence-transformers reads it
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key) is True] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1:
        raise NpqwenError(f"{folder / 'config.json'}: pooling modes {modes} are concatenated; npqwen pools one "
                          f"way ({', '.join(POOLING_MODES)})")
    if modes[0] not in POOLING_MODES:
        raise NpqwenError(f"{folder / 'config.json'}: pooling mode {modes[0]!r} is not one npqwen computes; it "
                          f"pools {', '.join(POOLING_MODES)}")
    if config.get("include_prompt", True) is not True:
        raise NpqwenError(f"{folder / 'config.json'}: include_prompt false (pooling that leaves the prompt's "
                          f"tokens out) is not something npqwen computes")
    return modes[0]


def _read_logit_score(folder: Path) -> tuple[int, int] | None:
    config = _read_json(folder / "config.json", {})
    ids = (config.get("true_token_id"), config.get("false_token_id")) if isinstance(config, dict) else ()
    return ids if all(is_integer(i) for i in ids) and ids else None


# -- pooling: what the engine calls for each chunk of a text --

def pooled_positions(mode: str, start: int, n: int, length: int, done: int) -> range:
    """The positions of a chunk (start .. start + n - 1 of a `length`-token text) whose final-norm
    states the pooling reads, leaving out the `done` first ones already pooled (a preempted request
    reads its text again)."""
    if mode == "lasttoken":
        return range(length - 1, length) if start + n == length else range(0)
    if mode == "cls":
        return range(0, 1) if start == 0 and done == 0 else range(0)
    return range(max(start, done), start + n)          # mean: every position


def pool_chunk(mode: str, pooled, states: np.ndarray):
    """The pooling after one more chunk: `states` (rows, D) float32 are the final-norm hidden states
    of the positions pooled_positions chose. "mean" keeps the running sum (see pooled_vector)."""
    if len(states) == 0:
        return pooled
    if mode == "mean":
        total = states.sum(axis=0, dtype=np.float32)                    # (D,)
        return total if pooled is None else pooled + total
    return states[-1].copy()                                            # lasttoken: the last row; cls: row 0


def pooled_vector(mode: str, pooled, length: int) -> np.ndarray:
    """The text's vector (D,) once every chunk is read: the mean divides the sum by the token count."""
    return (pooled / np.float32(length)).astype(np.float32) if mode == "mean" else pooled


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Unit-length rows, x / max(|x|, 1e-12), as torch.nn.functional.normalize."""
    norms = np.sqrt(np.einsum("nd,nd->n", x, x))[:, None]              # (n, 1)
    return (x / np.maximum(norms, np.float32(1e-12))).astype(np.float32)


# -- llm.embed --

def embed(llm, texts, instruction=None, prompt_name=None, dimensions=None, normalize=None) -> np.ndarray:
    """(n, d) float32 embeddings of `texts` (a string, token ids, or a list of either); see the module doc."""
    config = llm.embedding_config
    if config.problem is not None:
        raise NpqwenError(config.problem)
    ids = embedding_inputs(llm, texts, instruction, prompt_name)
    width = check_dimensions(dimensions, llm.config.hidden_size)
    if normalize is not None and not isinstance(normalize, bool):
        raise NpqwenError(f"normalize must be None (as the checkpoint says), True or False, got {normalize!r}")
    vectors = llm.run_prefill_only([llm.engine.new_embedding_request(x, config.pooling) for x in ids])
    return finish_vectors(config, np.stack([v.embedding for v in vectors]), width, normalize)


def finish_vectors(config: EmbeddingConfig, pooled: np.ndarray, width: int, normalize=None) -> np.ndarray:
    """(n, D) pooled states -> (n, width): Matryoshka keeps the first `width` values, then the Normalize
    module (or `normalize`) makes unit-length rows, as sentence-transformers' truncate_dim does."""
    out = np.ascontiguousarray(pooled[:, :width], dtype=np.float32)
    return normalize_rows(out) if (config.normalize if normalize is None else normalize) else out


def embedding_inputs(llm, texts, instruction=None, prompt_name=None, encode=None) -> list[list[int]]:
    """Each input's token ids, tokenized as sentence-transformers does: the prompt put before the text, the
    tokenizer's own special tokens (Qwen3-Embedding's appends <|endoftext|>); token ids are taken as they are.
    A text too long to embed is refused by its size before it is tokenized (Tokenizer.fewest_tokens).
    `encode(text, add_special_tokens)`: the tokenizing (the server's sends a long text to its tokenizer process)."""
    config = llm.embedding_config
    prompt = resolve_prompt(config, instruction, prompt_name)
    items = [texts] if isinstance(texts, str) or is_token_ids(texts) else texts
    if not isinstance(items, (list, tuple)) or not items:
        raise NpqwenError(f"texts must be a string, a list of token ids, or a non-empty list of either; "
                          f"got {type(texts).__name__} {str(texts)[:40]!r}")
    limit = min(config.max_seq_length or llm.config.max_position_embeddings, llm.config.max_position_embeddings)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            fewest = llm._tokenizer().fewest_tokens(item)   # a bound from its bytes alone: megabytes cost nothing
            if fewest > limit:
                raise InputTooLong(f"input {i} has {len(item)} characters, so at least {fewest} tokens, but this "
                                   f"model embeds at most {limit}; shorten it")
            ids = tokenize(llm._tokenizer(), config, prompt, item, encode)
        elif isinstance(item, (list, tuple, range, np.ndarray)) and len(item) == 0:
            raise NpqwenError(f"input {i} is an empty list of token ids: it has no tokens to embed")
        elif is_token_ids(item):
            if prompt:
                raise NpqwenError(f"input {i} is token ids, which take no prompt: put the prompt's tokens in the "
                                  f"ids, or pass text")
            ids = check_token_ids(item, llm.config.vocab_size).tolist()
        else:
            raise NpqwenError(f"input {i} is {type(item).__name__}; each input is a string or a list of token ids")
        if not ids:
            raise NpqwenError(f"input {i} is empty: it has no tokens to embed")
        if len(ids) > limit:
            raise InputTooLong(f"input {i} has {len(ids)} tokens, but this model embeds at most {limit}; shorten it "
                              f"(sentence-transformers would cut it to the first {limit})")
        out.append(ids)
    return out


def tokenize(tokenizer, config: EmbeddingConfig, prompt: str, text: str, encode=None) -> list[int]:
    """One text as sentence-transformers tokenizes it: prompt + text with the tokenizer's special tokens,
    or (the "message" modality) a system message with the prompt and a user message, chat-templated."""
    encode = encode or tokenizer.encode
    if config.do_lower_case:
        text = text.lower()
    if config.chat_template is None:
        return encode(prompt + text, True)
    messages = ([{"role": "system", "content": prompt}] if prompt else []) + [{"role": "user", "content": text}]
    kwargs = {"add_generation_prompt": False, **config.chat_template}
    return encode(tokenizer.apply_chat_template(messages, **kwargs), False)


def is_token_ids(x) -> bool:
    """One input given as token ids: a non-empty list/tuple/array of integers (not a list of strings)."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1
    return isinstance(x, (list, tuple, range)) and len(x) > 0 and all(is_integer(t) for t in x)


def resolve_prompt(config: EmbeddingConfig, instruction, prompt_name) -> str:
    """The text put before each input: Qwen3-Embedding's query form, a named prompt, the default one, or none."""
    if instruction is not None and prompt_name is not None:
        raise NpqwenError("give instruction or prompt_name, not both (an instruction makes the query prompt)")
    if instruction is not None:
        if not isinstance(instruction, str):
            raise NpqwenError(f"instruction must be a string, got {type(instruction).__name__}")
        return query_prompt(instruction)
    if prompt_name is None:
        prompt_name = config.default_prompt_name
        if prompt_name is None:
            return ""
    if prompt_name not in config.prompts:
        known = ", ".join(repr(k) for k in config.prompts) or "none"
        raise NpqwenError(f"prompt_name {prompt_name!r} is not one of this checkpoint's prompts ({known}; "
                          f"config_sentence_transformers.json)")
    return config.prompts[prompt_name]


def check_dimensions(dimensions, hidden_size: int) -> int:
    """How many leading values to keep: all (None) or 1 .. D."""
    if dimensions is None:
        return hidden_size
    if not is_integer(dimensions) or not 1 <= dimensions <= hidden_size:
        raise NpqwenError(f"dimensions must be an integer from 1 to {hidden_size} (the model's hidden size), "
                          f"got {dimensions!r}")
    return int(dimensions)
