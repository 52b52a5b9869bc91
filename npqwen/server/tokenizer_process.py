"""Tokenizing a prompt of megabytes in a process of its own.

A byte-level BPE tokenizer makes a few small objects per token (its text, its offsets): the
600k tokens of a 3 MB prompt are about 1 GB of small allocations. Once freed, glibc keeps them
(npqwen asks it to keep up to 1 GiB, see backend.keep_freed_memory), so a few such prompts would
leave the server gigabytes larger; and handing them back (malloc_trim) locks the allocator's
arenas for a tenth of a second, long enough to stall the engine thread and every stream. So
a long text is tokenized in one child process, which gives its memory back after each prompt
(there nobody waits on its locks), and the server only ever holds the ids. vLLM and SGLang also
tokenize in worker processes. The child is started on the first long text, by spawning a fresh
interpreter (forking a process that runs threads is unsafe), and ends when the server's process ends.
"""
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..backend import release_freed_memory
from ..errors import NpqwenError
from ..tokenizer import Tokenizer

LONG_TEXT_CHARS = 64 * 1024   # a longer text is tokenized in the child process (and first checked by its size)


class TokenizerProcess:
    """encode(text) in the child process, for the server's worker threads (each call blocks its thread)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pool: ProcessPoolExecutor | None = None
        self.lock = threading.Lock()

    def start(self) -> ProcessPoolExecutor:
        """The child's pool, started on first use."""
        with self.lock:
            if self.pool is None:
                self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=load, initargs=(self.tokenizer.backend.to_str(),))
            return self.pool

    def stopped(self, pool: ProcessPoolExecutor):
        """The child died (killed for its memory?): the next long text starts another."""
        with self.lock:
            if self.pool is pool:
                self.pool = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        pool = self.start()
        try:
            return pool.submit(encode, text, add_special_tokens).result()
        except BrokenProcessPool:
            self.stopped(pool)
            raise NpqwenError("the tokenizer process stopped while it read this prompt (out of memory?); "
                              "send a shorter prompt") from None

    async def too_long(self, chunks: list[bytes], context: int) -> tuple | None:
        """check_body in the child, awaited on the event loop (http.BigBodies); None if the child died."""
        def submit():   # in a thread: a first submit starts the child, writing it the tokenizer (11 MB for
            pool = self.start()   # Qwen3's) through a pipe it reads only once its interpreter is up
            return pool, pool.submit(check_body, chunks, context)
        pool, future = await asyncio.to_thread(submit)
        try:
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            self.stopped(pool)
            return None

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


# -- in the child process --

_tokenizer: Tokenizer | None = None


def load(spec: str):
    """The child's copy of the tokenizer, from its tokenizer.json text; the child ends with its parent."""
    global _tokenizer
    from tokenizers import Tokenizer as Backend

    threading.Thread(target=end_with_parent, daemon=True).start()
    _tokenizer = Tokenizer(Backend.from_str(spec))
    _tokenizer.fewest_tokens("")   # it reads the whole vocabulary once: now, not in a request's time


def end_with_parent():
    """Wait for the server's process to end, however it ended (kill -9, the kernel's OOM killer), then
    end this one: a server that is killed closes no pool, and the child would live on, holding its
    memory. multiprocessing's sentinel is a pipe end the parent holds, readable once it has gone."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def encode(text: str, add_special_tokens: bool) -> list[int]:
    try:
        return _tokenizer.encode(text, add_special_tokens)
    finally:
        release_freed_memory()


def check_body(chunks: list[bytes], context: int) -> tuple | None:
    """(path, characters, fewest tokens) of the first string in a JSON body that cannot fit a context
    of `context` tokens whatever the route does with it (Tokenizer.fewest_tokens: its bytes over the
    longest token's), or None: the body is not JSON, or every string might fit."""
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):   # the server's own parser says what is wrong with it
        return None
    finally:
        del chunks[:]
    todo = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            todo += [(f"{path}.{k}" if path else k, v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
        elif isinstance(value, str) and len(value) > LONG_TEXT_CHARS:
            fewest = _tokenizer.fewest_tokens(value)
            if fewest > context:
                return path, len(value), fewest
    return None
