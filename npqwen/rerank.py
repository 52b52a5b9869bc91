"""Reranking: how relevant is each document to a query, asked as a yes/no next-token question.

    scores = llm.rerank("What is the capital of China?",
                        ["The capital of China is Beijing.", "Gravity is a force."])   # (2,) in [0, 1]

Qwen3-Reranker is a causal language model fine-tuned to answer one question: does this document
meet the requirements of the query? The prompt is its model card's recipe: a system turn that
says the answer can only be "yes" or "no", the user turn `<Instruct>: ...\\n<Query>: ...\\n<Document>:
...`, and the assistant turn opened with an empty think block, so that the very next token is the
answer. The score is the probability of "yes" against "no" at that position,

    p(yes) = softmax([logit("no"), logit("yes")])[1] = sigmoid(logit("yes") - logit("no")),

and those two rows of lm_head are all that is computed of the vocabulary (engine/prefill_only.py).
It works on any Qwen3 checkpoint with an lm_head; only a reranker's scores mean something.

Every document's prompt begins with the same tokens (system turn, instruction, query). When that
shared part fills at least one KV page, the first document runs first and the others take its full
pages from the prefix cache instead of computing them again.
"""
import numpy as np

from .chat_format import THINK_CLOSE, THINK_OPEN
from .errors import NpqwenError

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = f"<|im_end|>\n<|im_start|>assistant\n{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"   # thinking off: the answer comes next
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def user_turn(instruction: str, query: str, document: str) -> str:
    """The model card's format_instruction."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def prompt_ids(tokenizer, instruction: str, query: str, document: str) -> list[int]:
    """Tokenized as the model card does it: the prefix, the user turn (with the tokenizer's own special
    tokens, as `tokenizer(pairs)` adds them) and the suffix, each on its own."""
    turn = tokenizer.encode(user_turn(instruction, query, document), add_special_tokens=True)
    return tokenizer.encode(PREFIX) + turn + tokenizer.encode(SUFFIX)


def no_yes_ids(llm) -> tuple[int, int]:
    """The token ids of "no" and "yes" (a CrossEncoder checkpoint's LogitScore names them)."""
    named = llm.embedding_config.yes_no_ids
    if named is not None:
        return named[1], named[0]
    tokenizer = llm._tokenizer()
    ids = tokenizer.token_to_id("no"), tokenizer.token_to_id("yes")
    if None in ids:
        raise NpqwenError('this tokenizer has no "yes" and "no" tokens, so it cannot answer the reranker\'s question '
                          '(--model tiny-reranker is a built-in one that has them)')
    return ids


def yes_probability(no_yes_logits: np.ndarray) -> np.ndarray:
    """p(yes) from the (n, 2) logits of "no" and "yes": a softmax over the two, as the model card computes it."""
    logits = np.asarray(no_yes_logits, dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return np.exp(shifted[:, 1]) / np.exp(shifted).sum(axis=1)


def rerank(llm, query: str, documents, instruction: str | None = None) -> np.ndarray:
    """One score in [0, 1] per document (in order): p(yes) that it meets the query's requirements."""
    if not isinstance(query, str):
        raise NpqwenError(f"query must be a string, got {type(query).__name__}")
    if isinstance(documents, str) or not isinstance(documents, (list, tuple)) or not documents:
        raise NpqwenError("documents must be a non-empty list of strings")
    bad = next((i for i, d in enumerate(documents) if not isinstance(d, str)), None)
    if bad is not None:
        raise NpqwenError(f"documents[{bad}] is {type(documents[bad]).__name__}; each document is a string")
    if instruction is not None and not isinstance(instruction, str):
        raise NpqwenError(f"instruction must be a string, got {type(instruction).__name__}")
    requests = scoring_requests(llm, llm.engine, query, documents, instruction)
    return yes_probability(np.stack([out.scores for out in llm.run_prefill_only(requests)]))


def scoring_requests(llm, engine, query: str, documents: list[str], instruction: str | None = None) -> list:
    """One engine request per document; its output is the logits of "no" and "yes" after the prompt."""
    instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
    tokenizer, ids = llm._tokenizer(), no_yes_ids(llm)
    requests = []
    for i, document in enumerate(documents):
        try:
            requests.append(engine.new_scoring_request(prompt_ids(tokenizer, instruction, query, document), ids))
        except NpqwenError as e:
            raise type(e)(f"documents[{i}]: {e}") from None   # an InputTooLong stays one
    share_prefix(requests, engine.page_size)
    return requests


def share_prefix(requests: list, page_size: int):
    """When the prompts share at least a full page, the others follow the first (scheduler: they wait
    until it has read its prompt, then take its pages from the prefix cache)."""
    first = requests[0].prompt_ids
    shared = min(common_prefix(first, r.prompt_ids) for r in requests[1:]) if len(requests) > 1 else 0
    if shared >= page_size:
        for r in requests[1:]:
            r.leader = requests[0]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
