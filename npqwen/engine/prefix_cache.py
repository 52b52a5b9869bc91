"""The prefix cache: full pages of keys/values that a request computed stay reusable by the
next request whose tokens start the same way (a shared system prompt, a chat's history).

A full page is known by a chain hash, hash(hash of the page before it, its P tokens), so one
hash names the whole prefix up to the end of that page (nano-vllm's scheme). A lookup checks
the tokens too, so a hash collision can never hand out the wrong keys. Pages whose last user
left (ref_count 0) wait in an LRU queue and are evicted, oldest first, only when the pool has
no free page left.

With a disk tier (prefix_disk.py, `prefix_cache_dir`), a prefix that runs on past the pages in memory
goes on from files: each page found there is read into a page taken as for new keys, and is from then
on a cached page like any other.

A hybrid model (Qwen3.5) can resume its linear-attention layers only where their states were kept
(state_snapshots.py): its hit is the longest cached prefix whose last page has a snapshot, and a page
evicted takes its snapshot with it.
"""
from collections import OrderedDict

from ..errors import NpqwenError
from .pages import PagePool
from .prefix_disk import DiskPages
from .state_snapshots import StateSnapshots


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int, enabled: bool = True, snapshots: StateSnapshots | None = None,
                 disk: DiskPages | None = None):
        self.pool, self.page_size, self.enabled = pool, page_size, enabled
        self.snapshots = snapshots                          # a hybrid model's state snapshots, else None
        self.disk = disk                                    # the pages kept in files (prefix_disk.py), else None
        self.by_hash: dict[int, int] = {}                   # chain hash -> page
        self.contents: dict[int, tuple] = {}                # page -> (parent hash, its tokens, hash)
        self.unused: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self.hit_tokens = 0                                 # positions served from the cache, cumulative

    def page_hash(self, parent: int | None, tokens) -> int:
        return hash((parent, tuple(tokens)))

    def match(self, tokens, max_pages: int, root=None) -> tuple[list[int], list[int]]:
        """The cached pages (and their chain hashes) that hold the longest prefix of `tokens`,
        at most max_pages of them; each page returned gains a reference. `root` is the first page's
        parent (Request.cache_root): None for the base model, else its LoRA adapter's and steering's
        key, so a prefix cached under one is never reused under another. A hybrid model's prefix
        ends at the last page that has a state snapshot: its linear layers resume from there."""
        found = self.lookup(tokens, max_pages, root)
        if self.snapshots is not None:
            found = found[:max((j + 1 for j, (_, h) in enumerate(found) if h in self.snapshots), default=0)]
        for page, _ in found:
            if self.pool.ref_count[page] == 0:
                del self.unused[page]
            self.pool.share(page)
        pages, hashes = [page for page, _ in found], [h for _, h in found]
        if self.disk is not None and root is None and len(pages) < max_pages:
            self.from_disk(tokens, max_pages, pages, hashes)
        return pages, hashes

    def from_disk(self, tokens, max_pages: int, pages: list, hashes: list):
        """Extend a match (pages, hashes, taken) with the pages that follow it in the disk tier's files: each
        is read into a page taken for it and registered here, until a file is missing or unsound, or no
        page can be taken."""
        P = self.page_size
        keys = self.disk.keys(tokens, max_pages, P)
        for j in range(len(pages), max_pages):
            if not self.disk.has(keys[j]):
                break
            page = self.take_page()
            if page is None:
                break
            chunk = tuple(tokens[j * P:(j + 1) * P])
            if not self.disk.load(keys[j], page, chunk):
                self.pool.release(page)
                self.pool.give_back(page)
                break
            hashes.append(self.register(page, hashes[-1] if hashes else None, chunk))
            pages.append(page)

    def lookup(self, tokens, max_pages: int, root=None) -> list[tuple[int, int]]:
        """(page, chain hash) of each cached page of the longest prefix of `tokens` (at most max_pages),
        whatever their snapshots; no reference is taken."""
        found, parent, P = [], root, self.page_size
        if not self.enabled:
            return found
        for j in range(max_pages):
            chunk = tuple(tokens[j * P:(j + 1) * P])
            h = self.page_hash(parent, chunk)
            page = self.by_hash.get(h)
            if page is None or self.contents[page][:2] != (parent, chunk):
                break
            found.append((page, h))
            parent = h
        return found

    def register(self, page: int, parent: int | None, tokens) -> int:
        """Remember what a just-filled page holds; its chain hash (for the next page's parent)."""
        h = self.page_hash(parent, tokens)
        if self.enabled and h not in self.by_hash and page not in self.contents:
            self.by_hash[h] = page
            self.contents[page] = (parent, tuple(tokens), h)
        return h

    def take_page(self) -> int | None:
        """A page for new keys/values: a free one, else the least recently used cached one
        (forgotten by the cache), else None."""
        page = self.pool.take()
        if page is None and self.unused:
            page, _ = self.unused.popitem(last=False)
            h = self.contents.pop(page)[2]
            del self.by_hash[h]
            if self.snapshots is not None:   # the states after this page are no use without its keys/values
                self.snapshots.drop(h)
            self.pool.ref_count[page] = 1
        return page

    def release(self, page: int):
        """A request lets go of a page: with no user left, it stays cached if it holds a known prefix."""
        if self.pool.release(page):
            if page in self.contents:
                self.unused[page] = None
            else:
                self.pool.give_back(page)

    @property
    def cached_pages(self) -> int:
        return len(self.unused)

    def check(self):
        """The cache's own invariants: hash table and page contents agree; unused pages are unreferenced."""
        for h, page in self.by_hash.items():
            if self.contents.get(page, (None, None, None))[2] != h:
                raise NpqwenError(f"prefix cache: hash {h} names page {page}, which holds something else")
        if len(self.contents) != len(self.by_hash):
            raise NpqwenError("prefix cache: a page is registered without its hash")
        for page in self.unused:
            if self.pool.ref_count[page] != 0 or page not in self.contents:
                raise NpqwenError(f"prefix cache: unused page {page} is referenced or unknown")
        if self.snapshots is not None:
            self.snapshots.check(self.by_hash)
