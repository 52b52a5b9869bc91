"""The prefix cache's disk tier: full pages of cached prefixes kept in files, so that a long preamble
(Claude Code's 27,000-token system prompt) is read once per machine, not once per server start.
Anchors: llama.cpp's slot save/restore, LMCache's disk tier.

A page's file is named by a chain key like the in-memory cache's hash, but one that is the same in every
process: sha256(the key of the page before it, its P token ids). The first page's parent is the model key:
sha256 of the model's files as they are on disk (config.json's bytes, each weight file's name, size and
modification time; not their contents, which would take seconds to read for a large model), the compute
dtype, the KV dtype, the page size and the cache's layout. So a file can only be found by the same model,
dtype and tokens; a changed weight file changes the key.

A file: one line of JSON (format, model key, the page's tokens, each array's dtype and shape, a CRC32 of the
rest) then every layer's keys and values of the page as stored (KVCache.page_arrays). It is written when
the engine fills a page (Engine._remember_full_pages) and read back when a prompt's prefix runs past what
is in memory (PrefixCache.match); a file that cannot be read, fails its CRC or names another model,
dtype or tokens is ignored with a warning. The folder is bounded: past `max_bytes` the least recently
used files (by modification time, touched on each read) are deleted. Only the base model's pages go to
disk: a LoRA adapter's or a steering's keys are theirs alone (Request.cache_root).
"""
import hashlib
import json
import os
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..backend import to_numpy
from ..errors import NpqwenError

FORMAT = "npqwen-kv-page-1"
SUFFIX = ".kvpage"


class PrefixWarning(UserWarning):
    """A prefix-cache file that was ignored (damaged, or another model's)."""


class DiskPages:
    def __init__(self, folder, model_key: str, kv, max_bytes: int):
        self.folder, self.model_key, self.kv, self.max_bytes = Path(folder), model_key, kv, max_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / ".npqwen-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise NpqwenError(f"{folder}: cannot use it as the prefix cache's folder ({e.strerror or e}); "
                              f"give a folder this user can write") from None
        # every page file here, least recently used first: name -> size
        files = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        self.files: OrderedDict[str, int] = OrderedDict((p.name, p.stat().st_size) for p in files)
        self.loaded_pages = self.saved_pages = 0

    def chain(self, parent: str, tokens) -> str:
        """The key of a page that holds `tokens` after the prefix whose last page's key is `parent`."""
        return hashlib.sha256(parent.encode() + np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()

    def keys(self, tokens, pages: int, page_size: int) -> list[str]:
        """The keys of the first `pages` pages of `tokens` (the base model's chain)."""
        keys, parent = [], self.model_key
        for j in range(pages):
            parent = self.chain(parent, tokens[j * page_size:(j + 1) * page_size])
            keys.append(parent)
        return keys

    def has(self, key: str) -> bool:
        return key + SUFFIX in self.files

    def save(self, key: str, page: int, tokens):
        """Write page `page` of the KV cache under `key`, unless a file has it already; then evict."""
        name = key + SUFFIX
        if name in self.files:
            return
        arrays = [np.ascontiguousarray(to_numpy(a)) for a in self.kv.page_arrays(page)]   # (L, K, P, Dh) each
        crc = 0
        for a in arrays:   # array by array: a page of a large model is tens of MB, never joined into one more copy
            crc = zlib.crc32(a, crc)
        header = {"format": FORMAT, "model": self.model_key, "tokens": [int(t) for t in tokens],
                  "arrays": [[a.dtype.str, list(a.shape)] for a in arrays], "crc32": crc}
        temporary = self.folder / f".{name}.{os.getpid()}.tmp"
        try:   # written aside, then renamed: a reader never sees half a file
            with open(temporary, "wb") as f:
                f.write(json.dumps(header).encode() + b"\n")
                for a in arrays:
                    f.write(a)
            os.replace(temporary, self.folder / name)
        except OSError as e:
            temporary.unlink(missing_ok=True)
            warnings.warn(f"{self.folder}: could not write a prefix-cache page ({e.strerror or e}); it stays in "
                          f"memory only", PrefixWarning, stacklevel=2)
            return
        self.files[name] = sum(a.nbytes for a in arrays)
        self.saved_pages += 1
        self.evict()

    def load(self, key: str, page: int, tokens) -> bool:
        """Fill page `page` of the KV cache from the file of `key`: True if there is one and it is sound
        (this model's, these tokens, the right shapes, its CRC); a file that is not is ignored with a warning."""
        name = key + SUFFIX
        if name not in self.files:
            return False
        path = self.folder / name
        try:
            with open(path, "rb") as f:
                header = json.loads(f.readline())
                payload = f.read()
            wanted = [to_numpy(a) for a in self.kv.page_arrays(page)]
            problem = self.problem(header, payload, tokens, wanted)
        except FileNotFoundError:   # another process sharing the folder evicted it: nothing wrong
            self.files.pop(name, None)
            return False
        except (OSError, ValueError, TypeError, KeyError) as e:
            problem = f"it cannot be read ({e})"
        if problem:
            warnings.warn(f"{path}: ignored: {problem}", PrefixWarning, stacklevel=2)
            self.files.pop(name, None)
            return False
        arrays, offset = [], 0
        for a in wanted:
            arrays.append(np.frombuffer(payload, a.dtype, a.size, offset).reshape(a.shape))
            offset += a.nbytes
        self.kv.set_page_arrays(page, arrays)
        os.utime(path)                      # its use, for the LRU order of this and later processes
        self.files.move_to_end(name)
        self.loaded_pages += 1
        return True

    def problem(self, header: dict, payload: bytes, tokens, wanted: list) -> str | None:
        """What is wrong with a page file, or None."""
        if header.get("format") != FORMAT:
            return f"not an npqwen KV page of format {FORMAT}"
        if header.get("model") != self.model_key:
            return "it was written for another model, dtype or page size"
        if header.get("tokens") != [int(t) for t in tokens]:
            return "its tokens are not the prefix it is named for"
        if header.get("arrays") != [[a.dtype.str, list(a.shape)] for a in wanted]:
            return f"its arrays {header.get('arrays')} are not this cache's"
        if len(payload) != sum(a.nbytes for a in wanted) or zlib.crc32(payload) != header.get("crc32"):
            return "it is damaged (its size or CRC32 does not match)"
        return None

    def evict(self):
        """Delete the least recently used files while the folder holds more than max_bytes."""
        total = sum(self.files.values())
        while total > self.max_bytes and self.files:
            name, size = self.files.popitem(last=False)
            (self.folder / name).unlink(missing_ok=True)
            total -= size


def model_key(llm, kv_dtype: str, page_size: int) -> str:
    """sha256 of what the keys and values of a prefix depend on: the model's files (config.json's bytes, each
    other file's name, size and modification time), or for a built-in model its name and weights; the
    compute dtype, the KV dtype, the page size and the weights' formats (compact weights compute other keys)."""
    h = hashlib.sha256(FORMAT.encode())
    path = getattr(llm, "path", None)
    if path is None:   # a built-in model made in memory: its weights are small
        for name, w in sorted(llm.model.weights.items()):
            h.update(name.encode())
            for a in getattr(w, "arrays", [w]):
                h.update(np.ascontiguousarray(to_numpy(a)).tobytes())
    else:
        path = Path(path)
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        for p in files:
            stat = p.stat()
            seen = p.read_bytes() if p.name == "config.json" else f"{p.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()
            h.update(seen)
    formats = sorted({getattr(w, "format", str(getattr(w, "dtype", ""))) for w in llm.model.weights.values()})
    h.update(json.dumps([str(llm.model.dtype), kv_dtype, page_size, formats]).encode())
    return h.hexdigest()
