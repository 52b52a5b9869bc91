"""The page pool: which KV-cache pages are free, which are in use and by how many requests.

A page is in exactly one of three states:
    free     - in `free`, holds nothing anyone wants;
    in use   - ref_count > 0: that many requests have it in their page table (more than one
               only when they share a cached prompt prefix);
    cached   - ref_count == 0 but the prefix cache still knows what it holds, so a later
               request with the same prefix can take it back (see prefix_cache.py).
The pool never grows: its size is fixed when the engine starts.
"""
from ..errors import NpqwenError


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref_count = [0] * num_pages
        # Taken from the end: the most recently freed page is reused first, so on the CPU the
        # zero-filled cache becomes resident only as far as it is actually needed.
        self.free = list(range(num_pages - 1, -1, -1))

    def take(self) -> int | None:
        """A free page with ref_count 1, or None when no page is free."""
        if not self.free:
            return None
        page = self.free.pop()
        self.ref_count[page] = 1
        return page

    def share(self, page: int):
        self.ref_count[page] += 1

    def release(self, page: int) -> bool:
        """Drop one reference; True when that was the last one (the caller decides: free or cached)."""
        self.ref_count[page] -= 1
        return self.ref_count[page] == 0

    def give_back(self, page: int):
        """An unreferenced page nobody can reuse goes back on the free list."""
        self.free.append(page)

    def check(self, page_tables, cached_pages):
        """The bookkeeping invariants; raises NpqwenError naming the first one broken.

        free + cached + in use = total, each page in one state only, and every in-use page's
        ref_count equals the number of page tables that hold it.
        """
        holders = [0] * self.num_pages
        for table in page_tables:
            if len(set(table)) != len(table):
                raise NpqwenError(f"page table {table} holds a page twice")
            for page in table:
                holders[page] += 1
        free, cached = set(self.free), set(cached_pages)
        in_use = {p for p in range(self.num_pages) if holders[p] > 0}
        if len(free) != len(self.free):
            raise NpqwenError("a page is on the free list twice")
        if free & cached or free & in_use or cached & in_use:
            raise NpqwenError(f"pages in two states: free&cached {free & cached}, free&used {free & in_use}, "
                              f"cached&used {cached & in_use}")
        if len(free) + len(cached) + len(in_use) != self.num_pages:
            raise NpqwenError(f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != "
                              f"{self.num_pages} pages")
        wrong = [p for p in range(self.num_pages) if self.ref_count[p] != holders[p]]
        if wrong:
            p = wrong[0]
            raise NpqwenError(f"page {p}: ref_count {self.ref_count[p]} but {holders[p]} page tables hold it")
