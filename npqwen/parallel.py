"""Tensor parallelism: one Qwen3 over N processes (ranks), each holding 1/N of every layer.

The split, by HF name (Megatron-LM's, as vLLM, SGLang, nano-vllm and mini-sglang make it):
    q_proj, k_proj, v_proj   column-parallel: rank r keeps the rows of its H/N query heads and of the
                             key/value heads those read (a GQA group stays on one rank); Qwen2's
                             biases on them, the same rows
    o_proj                   row-parallel: the columns of those heads; each rank's product is a part
                             of the output, and one all-reduce adds the parts up
    gate_proj, up_proj       column-parallel: F/N rows each (a slice of the MLP's width)
    down_proj                row-parallel: the same F/N columns; one all-reduce
    embed_tokens, lm_head    vocabulary-parallel: V/N rows; a token's embedding is on one rank (the
                             others give zeros: an all-reduce), and each rank computes the logits of
                             its V/N tokens (an all-gather)
    norms                    on every rank, whole
A Qwen3.5 model splits its two kinds of layer by heads as well:
    self_attn.q_proj         each query head's Dh query rows and the Dh rows of its output gate, together
    linear_attn.in_proj_qkv  rank r's Hk/N key heads' q rows and k rows, and its Hv/N value heads' v rows
                             (a key head's Hv/Hk value heads stay with it); conv1d's channels the same way
    in_proj_z, in_proj_b, in_proj_a, A_log, dt_bias   the rows of its value heads
    out_proj                 row-parallel: the columns of its value heads; one all-reduce
    in_proj_qkvz, in_proj_ba Qwen3-Next's, whose rows come grouped by key head: its key heads' groups
and each rank's state slots hold only its own heads' states (kv_cache.LinearStates).
So a decoder layer costs two all-reduces of (T, D); why the parts add up to the whole product is in
docs/parallel.md. The rule goes by the name's ending and the tensor's own shape, so a Qwen3-MoE
expert's gate_proj / up_proj / down_proj are split by their width in the same way (every rank
holds a slice of every expert, the router whole; the MoE layer then needs its one all-reduce after
the sum over its experts), which keeps every rank equally busy however the router picks experts.

A Qwen4-Exp model splits as Qwen3.5-MoE does (attention and linear-attention heads, every expert's and the shared
expert's width, the vocabulary); its three new parts are whole on every rank, each computed alike everywhere from
the streams every rank holds whole after the all-reduces (bitwise equal on every rank: the all-reduce hands
every rank the same sums, as MPICH's does; QSA's discrete block selection relies on it, and the tests check every
rank's logits equal rank 0's exactly):
    *_hyper_connection, hyper_connection_mixer   the C streams (T, C*D) and their mixing: a low-rank gate of
                             2*C*D*R + C*C*D weights per block (10M a layer in the real model, against 27M of
                             attention and 1.6B of experts); split, it would need an all-reduce of (T, C*D) each
    ple                      key_proj, value_proj, norms, the dilated convolution and its state (L, C*D) per slot;
                             the n-gram tables stay on disk, each rank mapping the same file (one copy in the page
                             cache of one machine)
    self_attn.indexer        QSA's index_qk_proj and norms: a block's score sums relu(q . k) over all Hi indexer
                             heads against one key head before the top-k, so each rank computes the whole selection
                             (4.5M weights a layer at D=2048 with 16 heads of 128) and keeps the raw indexer
                             keys in its pages, rather than all-reducing (T, blocks) scores per sequence and layer
So a Qwen4-Exp layer costs the all-reduces of (T, D) a Qwen3.5-MoE layer does (after o_proj or out_proj, the
experts' sum and the shared expert's down_proj), and no more.

When N does not divide the K key/value heads: if N is a multiple of K, each key/value head is kept
by N/K ranks, which split its query heads (vLLM's replication); otherwise the split is refused
with the sizes. H must be a multiple of N.

Who does what: rank 0 leads. Every forward pass starts with rank 0 sending the others its Batch
(token ids, positions, page tables) and which KV cache it writes to (`share_batch`); the others run
it on their shard, and every rank gets the same gathered logits. The engine, its scheduler and
sampling run on rank 0 only; the other ranks keep a KV cache of the same pages for their own heads.
Calls that only rank 0 can run (`rank_0_leads`: the Engine's methods, LLM.generate / stream / chat)
run there while the other ranks `follow` its forward passes, and then hand every rank rank 0's
result; so a script run on every rank (`mpiexec -n 2 python script.py`) gets the same answers
everywhere. `npqwen generate|chat|serve --tensor-parallel-size N` is rank 0 leading for its whole
run, the other ranks following until it stops (npqwen/cli/parallel.py).
"""
import functools
import inspect
import weakref

import numpy as np

from .comm import GroupFailed, MPICommunicator, SingleProcess
from .errors import NpqwenError
from .kv_cache import LinearStates, copy_states

MAX_ERROR_BYTES = 2000   # of a rank's load error, as the other ranks see it

# ---------------------------------------------------------------------------- the split

def split_range(n: int, parts: int, i: int) -> range:
    """Part i of range(n) cut into `parts` consecutive pieces, the first n % parts one longer."""
    size, extra = divmod(n, parts)
    start = i * size + min(i, extra)
    return range(start, start + size + (i < extra))


def check_split(config, n: int):
    """N ranks must split the heads whole: H a multiple of N, and K a multiple of N or N of K."""
    H, K = config.num_attention_heads, config.num_key_value_heads
    if n < 1:
        raise NpqwenError(f"the tensor-parallel size must be >= 1, got {n}")
    if getattr(config, "hybrid", False):
        check_linear_split(config, n)
    if H % n:
        raise NpqwenError(f"a tensor-parallel size of {n} does not split the model's {H} query heads "
                          f"(num_attention_heads) evenly; use a divisor of {H}: "
                          f"{', '.join(str(d) for d in range(1, H + 1) if H % d == 0)}")
    if K % n and n % K:
        raise NpqwenError(f"a tensor-parallel size of {n} splits the {H} query heads but not the {K} key/value "
                          f"heads (num_key_value_heads): neither divides the other, so a key/value head would "
                          f"serve query heads on two ranks; use a size that divides {K} or a multiple of it")


def check_linear_split(config, n: int):
    """A Gated DeltaNet layer splits by whole heads: Hk and Hv multiples of N (a key head's Hv/Hk value heads
    then stay on its rank)."""
    for field in ("linear_num_key_heads", "linear_num_value_heads"):
        heads = getattr(config, field)
        if heads % n:
            raise NpqwenError(f"a tensor-parallel size of {n} does not split the model's {heads} linear-attention "
                              f"{'key' if 'key' in field else 'value'} heads ({field}) evenly; use a size that "
                              f"divides both linear_num_key_heads ({config.linear_num_key_heads}) and "
                              f"linear_num_value_heads ({config.linear_num_value_heads})")


def linear_heads_of(config, n: int, r: int) -> tuple[range, range]:
    """(key heads, value heads) of rank r of n in a Gated DeltaNet layer: Hk/n and Hv/n consecutive ones, so
    value head h's key head h // (Hv/Hk) is on the same rank."""
    return (split_range(config.linear_num_key_heads, n, r), split_range(config.linear_num_value_heads, n, r))


def linear_qkv_rows(config, n: int, r: int) -> np.ndarray:
    """Rank r's rows of in_proj_qkv (and channels of conv1d), laid out [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)]:
    its key heads' q rows, their k rows, its value heads' v rows, in that order."""
    Hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    keys, values = linear_heads_of(config, n, r)
    q = np.arange(keys.start * dk, keys.stop * dk)
    return np.concatenate([q, Hk * dk + q, 2 * Hk * dk + np.arange(values.start * dv, values.stop * dv)])


def heads_of(config, n: int, r: int) -> tuple[range, range]:
    """(query heads, key/value heads) of rank r of n. Query head h reads key/value head h // G, so a
    rank's H/n query heads read K/n whole heads, or (n > K) share one head with n/K - 1 other ranks."""
    H, K = config.num_attention_heads, config.num_key_value_heads
    q = split_range(H, n, r)
    if n <= K:
        return q, split_range(K, n, r)
    kv = q.start // (H // K)                      # n/K ranks per key/value head: each keeps a copy
    return q, range(kv, kv + 1)


def shards(config, shapes: dict, n: int, r: int) -> dict[str, tuple[slice, ...]]:
    """What rank r of n keeps of each tensor (HF name -> HF shape): a slice per axis (rows, columns); rows
    are an index array where they come in several runs (a Gated DeltaNet's q, k and v)."""
    Dh, every = config.head_dim, slice(None)
    q, kv = heads_of(config, n, r)
    Q = Dh * (2 if getattr(config, "hybrid", False) else 1)   # rows per query head: Qwen3.5's also hold its gate
    if getattr(config, "hybrid", False):
        keys, values = linear_heads_of(config, n, r)
        qkv, dv = linear_qkv_rows(config, n, r), config.linear_value_head_dim
        group = 2 * config.linear_key_head_dim + 2 * dv * len(values) // len(keys)   # Qwen3-Next: rows per key head

    def of(r_: range) -> slice:
        return slice(r_.start, r_.stop)

    parts = {}
    for name, shape in shapes.items():
        if any(part in name for part in (".indexer.", ".ple.", "hyper_connection")):   # Qwen4-Exp's: whole (above)
            parts[name] = (every,) * len(shape)   # (index_qk_proj is no k_proj, ple.conv1d no linear conv1d)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):   # (Qwen2's biases: split with their rows)
            parts[name] = (slice(q.start * Q, q.stop * Q), every)[:len(shape)]        # its query heads' rows
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            parts[name] = (slice(kv.start * Dh, kv.stop * Dh), every)[:len(shape)]   # its key/value heads' rows
        elif name.endswith("o_proj.weight"):
            parts[name] = (every, slice(q.start * Dh, q.stop * Dh))                   # its heads' columns
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            parts[name] = (of(split_range(shape[0], n, r)), every)                    # a slice of the width
        elif name.endswith("down_proj.weight"):
            parts[name] = (every, of(split_range(shape[1], n, r)))                    # the same slice, as columns
        elif name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            parts[name] = (qkv, every)                                                # its heads' q, k, v rows
        elif name.endswith("in_proj_qkvz.weight"):   # Qwen3-Next: [q, k, v, z] of each key head, in turn
            parts[name] = (slice(keys.start * group, keys.stop * group), every)       # its key heads' groups
        elif name.endswith("in_proj_ba.weight"):     # ... and [b, a] of each key head (2 Hv/Hk rows)
            rows = 2 * len(values) // len(keys)
            parts[name] = (slice(keys.start * rows, keys.stop * rows), every)
        elif name.endswith("in_proj_z.weight"):
            parts[name] = (slice(values.start * dv, values.stop * dv), every)         # its value heads' rows
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            parts[name] = (slice(values.start, values.stop),) + (every,) * (len(shape) - 1)   # one per value head
        elif name.endswith("out_proj.weight"):
            parts[name] = (every, slice(values.start * dv, values.stop * dv))         # its value heads' columns
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            parts[name] = (of(split_range(shape[0], n, r)), every)                    # a slice of the vocabulary
        else:
            parts[name] = (every,) * len(shape)                                       # norms: whole
    return parts


def shard_shape(shape: tuple, part: tuple) -> tuple:
    """The shape of a tensor's part (a slice or an index array per axis)."""
    return tuple(len(s) if isinstance(s, np.ndarray) else len(range(*s.indices(d))) for s, d in zip(part, shape)) \
        + tuple(shape[len(part):])


def communicator(tensor_parallel, device: str):
    """SingleProcess for False; for True, MPI's world (one rank per process mpiexec started); a given
    communicator as it is."""
    if tensor_parallel is False or tensor_parallel is None:
        return SingleProcess()
    if device != "cpu":
        raise NpqwenError("tensor parallelism runs on the CPU (MPI over NumPy buffers); on CUDA it would need NCCL "
                          "(see npqwen/comm.py); use device='cpu'")
    return MPICommunicator() if tensor_parallel is True else tensor_parallel


def agreed(comm, load):
    """load() on every rank; if it failed on any, every rank raises one error that says which and why.

    Each rank reads its own part (its own disk, on several machines), so one may fail where the
    others do not; without this they would wait for it forever in the first forward pass."""
    if comm.size == 1:
        return load()
    error = result = None
    try:
        result = load()
    except Exception as e:   # every kind: MemoryError, OSError too; they are reported, not hidden
        error = str(e) if isinstance(e, NpqwenError) else f"{type(e).__name__}: {e}"
    sent = np.zeros((1, MAX_ERROR_BYTES), dtype=np.uint8)             # each rank's error, "" if none
    text = (error or "").encode()[:MAX_ERROR_BYTES]
    sent[0, :len(text)] = np.frombuffer(text, dtype=np.uint8)
    gathered = comm.all_gather(sent, patient=True).reshape(comm.size, MAX_ERROR_BYTES)   # (ranks, bytes)
    errors = [(r, row.tobytes().rstrip(b"\0").decode(errors="replace")) for r, row in enumerate(gathered)]
    errors = [(r, e) for r, e in errors if e]
    if not errors:
        return result
    if len(errors) == comm.size and len({e for _, e in errors}) == 1:   # the same on every rank: the model's fault
        raise NpqwenError(errors[0][1])
    raise NpqwenError("; ".join(f"rank {r} of {comm.size} could not load its part of the model: {e}"
                                for r, e in errors))


# ---------------------------------------------------------------------------- rank 0 leads, the others follow

def share_batch(model, batch, kv, recording: bool):
    """Step 0 of a forward pass: every rank runs rank 0's batch.

    Rank 0 sends it with the key of its KV cache; a rank inside `follow` already has it; a rank
    running the same script as rank 0 takes rank 0's copy (its own is the same). One process: nothing."""
    comm = model.comm
    if comm.size == 1 or comm.following:
        return batch
    if comm.rank == 0:
        comm.broadcast(("batch", batch, cache_key(comm, kv), recording))
        return batch
    kind, *rest = comm.broadcast(patient=True)
    if kind != "batch":
        raise out_of_step(comm, "a forward pass", kind)
    return rest[0]


def cache_key(comm, kv) -> tuple:
    """(key, pages, page size, state slots, snapshot slots, keys of caches rank 0 has let go of, its copies
    between state slots and snapshots and its speculative roll-backs since the last batch, the KV dtype): how the
    followers find and keep their copy."""
    key = comm.kv_keys.get(kv)
    if key is None:
        key = comm.kv_keys[kv] = next(comm.kv_counter)
        weakref.finalize(kv, lambda k=key: comm.freed.append(k))
    freed, comm.freed = comm.freed, []
    copies = list(kv.state_copies or ())
    if kv.state_copies:
        kv.state_copies.clear()
    slots = kv.states.num_slots if kv.states is not None else 1
    snapshots = kv.snapshots.num_slots if kv.snapshots is not None else 0
    return key, kv.num_pages, kv.page_size, slots, snapshots, freed, copies, kv.kv_dtype


def follow(model) -> tuple[str, object]:
    """A rank > 0: run rank 0's forward passes, each on this rank's KV cache for rank 0's, until rank 0
    ends the call it leads ("end", its result) or its whole run ("stop", an exit code)."""
    comm = model.comm
    comm.following = True
    try:
        while True:
            kind, *rest = comm.broadcast(patient=True)
            if kind == "batch":
                batch, (key, pages, page_size, slots, snapshots, freed, copies, kv_dtype), recording = rest
                for k in freed:
                    comm.caches.pop(k, None)
                kv = comm.caches.get(key)
                if kv is None:   # the same pages (and state slots) as rank 0's cache, for this rank's heads
                    kv = comm.caches[key] = model.new_kv_cache(pages, page_size, slots, kv_dtype)
                    kv.snapshots = LinearStates(model.config, snapshots, model.xp, model.dtype,
                                                model.linear_heads) if snapshots else None
                for what, i, j in copies:   # rank 0's prefix cache saved (slot i -> snapshot j) or restored states,
                    if what == "roll_back":   # or a speculative verification of slot i kept its first j tokens
                        kv.states.roll_back(i, j)
                        continue
                    src, dst = (kv.states, kv.snapshots) if what == "save" else (kv.snapshots, kv.states)
                    copy_states(src, i, dst, j)
                model.forward_batch(batch, kv, keep_nothing if recording else None)
            elif kind in ("end", "stop"):
                return kind, rest
            else:
                raise out_of_step(comm, "rank 0's next step", kind)
    finally:
        comm.following = False


def keep_nothing(name, array):
    """A follower's recorder when rank 0 records: the same steps run (attention probabilities too), nothing is kept."""


def rank_0_leads(method):
    """Rank 0 runs the method; the other ranks follow its forward passes meanwhile, then return its
    result (or raise its error). A generator it returns (LLM.stream) is led item by item. One
    process, or a call inside one rank 0 leads already: the method."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        comm = comm_of(self, method, args, kwargs)
        if comm.size == 1 or comm.leading:
            return method(self, *args, **kwargs)
        if comm.rank > 0:
            if method.__name__ == "__init__":   # rank 0's object: here it only knows its LLM
                self.llm = args[0] if args else kwargs["llm"]
            result = ended(follow(model_of(self)), comm, method)
            return following_items(model_of(self), comm, method) if isinstance(result, Items) else result
        with leading(comm, method):
            result = method(self, *args, **kwargs)
        if inspect.isgenerator(result):
            comm.broadcast(("end", method.__qualname__, Items(), None))
            return leading_items(result, comm, method)
        comm.broadcast(("end", method.__qualname__, result, None))
        return result
    return run


class Items:
    """Rank 0's call returned a generator: its items follow, each in an "end" message of its own."""


def leading_items(items, comm, method):
    """Rank 0: each item of `items`, computed while the others follow, then handed to them."""
    done = object()
    while True:
        with leading(comm, method):
            item = next(items, done)
        if item is done:
            comm.broadcast(("end", method.__qualname__, ("return", None), None))
            return
        comm.broadcast(("end", method.__qualname__, ("item", item), None))
        try:
            yield item
        except GeneratorExit:   # closed early (its request is aborted): the others close theirs too
            with leading(comm, method):
                items.close()
            comm.broadcast(("end", method.__qualname__, ("closed", None), None))
            raise


def following_items(model, comm, method):
    """The other ranks: rank 0's items, as they come."""
    while True:
        kind, item = ended(follow(model), comm, method)
        if kind == "return":
            return
        try:
            yield item
        except GeneratorExit:   # closed here as on rank 0: take rank 0's word that it closed too
            ended(follow(model), comm, method)
            raise


class leading:
    """Rank 0 inside a call it leads: the calls it makes run directly; an NpqwenError ends the call on
    every rank; any other exception leaves the others mid-step, so the group is ended."""

    def __init__(self, comm, method):
        self.comm, self.name = comm, method.__qualname__

    def __enter__(self):
        self.comm.leading += 1

    def __exit__(self, kind, error, trace):
        self.comm.leading -= 1
        if error is None or isinstance(error, GroupFailed):
            return False
        if isinstance(error, NpqwenError):
            self.comm.broadcast(("end", self.name, None, str(error)))
        elif self.comm.failed is None:
            self.comm.failed = f"tensor parallel: rank 0 failed in {self.name} ({kind.__name__}: {error})"
        return False


def ended(message: tuple, comm, method):
    """rank 0's result for `method`, or its error raised here."""
    kind, rest = message
    if kind == "stop":
        raise GroupFailed(f"tensor parallel: rank 0 stopped (exit code {rest[0]}) while rank {comm.rank} was in "
                          f"{method.__qualname__}")
    name, result, error = rest
    if name != method.__qualname__:
        comm.failed = (f"tensor parallel: rank {comm.rank} called {method.__qualname__} while rank 0 ran {name}; "
                       f"every rank must make the same calls in the same order")
        raise GroupFailed(comm.failed)
    if error is not None:
        raise NpqwenError(error)
    return result


def out_of_step(comm, what: str, kind: str) -> GroupFailed:
    comm.failed = (f"tensor parallel: rank {comm.rank} expected {what} but rank 0 sent {kind!r}; every rank must "
                   f"make the same calls in the same order")
    return GroupFailed(comm.failed)


def comm_of(self, method, args, kwargs):
    """The communicator of an LLM, or of an Engine (its LLM's; given to __init__ as its first argument)."""
    if hasattr(self, "comm"):
        return self.comm
    return (self.llm if method.__name__ != "__init__" else args[0] if args else kwargs["llm"]).comm


def model_of(self):
    return self.llm.model if hasattr(self, "llm") else self.model


def take_shards(weights: dict, parts: dict, target: dict):
    """Copy each full tensor's part into the rank's own arrays (the built-in tiny model, made whole in memory)."""
    for name, array in target.items():
        array[...] = weights[name][parts[name]]

