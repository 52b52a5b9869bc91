"""The state slots of a hybrid model (Qwen3.5): which per-request linear-attention states are free.

A Gated DeltaNet layer keeps one fixed-size state per sequence (kv_cache.LinearStates): its
convolution's last inputs and its delta-rule matrices. The engine holds max_batch_size slots of
them beside the KV pages; a running request holds exactly one, from admission until it finishes,
is preempted or aborted. A slot is reused as it is: the model starts a sequence's states from
zero when it computes position 0 (model.forward_batch), and a prefix hit fills the slot from a
snapshot (state_snapshots.py), so nothing is cleared here.
"""
from ..errors import NpqwenError


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))   # taken from the end: slot 0 first

    def take(self) -> int:
        """A free slot. The scheduler admits at most max_batch_size running requests, one slot each,
        so one is always free when it asks."""
        if not self.free:
            raise NpqwenError("no linear-attention state slot is free: more running requests than max_batch_size")
        return self.free.pop()

    def release(self, slot: int):
        self.free.append(slot)

    def check(self, held: list):
        """The bookkeeping invariants: free + held = total, no slot held twice or both free and held."""
        check_slots(self.free, held, self.num_slots, "state slot", "by two requests")


def check_slots(free_list: list, held: list, num_slots: int, name: str, held_twice: str):
    """A pool of `num_slots` numbered slots (state slots, state snapshots): free + held = total, no slot held
    twice, on the free list twice, or both free and held; `name` and `held_twice` word the errors."""
    if len(set(held)) != len(held):
        raise NpqwenError(f"a {name} is held {held_twice}: {sorted(held)}")
    free = set(free_list)
    if len(free) != len(free_list):
        raise NpqwenError(f"a {name} is on the free list twice")
    if free & set(held):
        raise NpqwenError(f"{name}s both free and held: {sorted(free & set(held))}")
    if len(free) + len(held) != num_slots:
        raise NpqwenError(f"free {len(free)} + held {len(held)} != {num_slots} {name}s")
