"""State snapshots: what lets a hybrid model (Qwen3.5) reuse a cached prefix.

A prefix hit hands a request the KV pages of a prompt prefix that another request computed, so its
full-attention layers start after that prefix. Its linear-attention layers need more: their states
(kv_cache.LinearStates: conv inputs and delta-rule matrices) *at the end of that prefix*, and a
request's state slot only ever holds its states after its latest token. So the engine keeps copies:
a snapshot is "every linear layer's states after the tokens up to the end of this cached page", kept
under the page's chain hash (prefix_cache.py), in one of N snapshot slots beside the state slots.

A request takes one where a prefill chunk of its ends on a page boundary it chose beforehand
(Scheduler.snapshot_points: the scheduler ends a chunk there); a hit restores one into the hitting
request's state slot. Snapshots are evicted least recently used first when the slots run out, and go
with their page when the prefix cache evicts it. vLLM keeps its hybrid models' states the same way.
"""
from collections import OrderedDict

from ..errors import NpqwenError
from ..kv_cache import LinearStates, copy_states
from .state_slots import check_slots


class StateSnapshots:
    def __init__(self, states: LinearStates, store: LinearStates, log: list | None = None):
        self.states, self.store = states, store   # the requests' state slots; the snapshots' own slots
        self.log = log   # tensor parallel: each copy, for the other ranks to make too (parallel.cache_key); None: none
        self.num_slots = store.num_slots
        self.by_hash: OrderedDict[int, int] = OrderedDict()   # page chain hash -> snapshot slot, oldest use first
        self.free = list(range(self.num_slots - 1, -1, -1))

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self.by_hash

    def save(self, page_hash: int, slot: int):
        """Copy state slot `slot` into a snapshot of the prefix that ends with page `page_hash`; when no
        snapshot slot is free, the least recently used snapshot gives its slot up."""
        if page_hash in self.by_hash:   # another request took it already: the same states
            self.by_hash.move_to_end(page_hash)
            return
        if self.free:
            k = self.free.pop()
        else:
            _, k = self.by_hash.popitem(last=False)
        copy_states(self.states, slot, self.store, k)
        self.logged("save", slot, k)
        self.by_hash[page_hash] = k

    def restore(self, page_hash: int, slot: int):
        """Fill state slot `slot` with the snapshot of the prefix that ends with page `page_hash`."""
        self.by_hash.move_to_end(page_hash)
        copy_states(self.store, self.by_hash[page_hash], self.states, slot)
        self.logged("restore", self.by_hash[page_hash], slot)

    def logged(self, kind: str, i: int, j: int):
        if self.log is not None:
            self.log.append((kind, i, j))

    def drop(self, page_hash: int):
        """The prefix cache forgot this page: its snapshot goes too."""
        k = self.by_hash.pop(page_hash, None)
        if k is not None:
            self.free.append(k)

    def check(self, known_hashes):
        """The bookkeeping invariants: free + held = total, no slot held twice or both free and held,
        and every snapshot belongs to a page the prefix cache still knows."""
        check_slots(self.free, list(self.by_hash.values()), self.num_slots, "state snapshot slot", "for two prefixes")
        unknown = [h for h in self.by_hash if h not in known_hashes]
        if unknown:
            raise NpqwenError(f"state snapshots of {len(unknown)} pages the prefix cache no longer knows")
