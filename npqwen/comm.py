"""How the ranks of a tensor-parallel group meet: all-reduce, all-gather, broadcast.

    comm.size, comm.rank     how many processes hold the model, and which one this is (rank 0 leads)
    comm.all_reduce(x)       the sum of every rank's x (same shape on each), on every rank
    comm.all_gather(x)       every rank's x side by side along the last axis, in rank order, on every rank
    comm.broadcast(obj)      rank 0's obj (any picklable value), on every rank

`SingleProcess` is the communicator of one process: each collective returns its input, so the
model code is the same with and without tensor parallelism. `MPICommunicator` runs them over MPI
(mpi4py) on NumPy buffers, the way HPC clusters connect their machines.

A collective never hangs. MPI has no timeouts: a blocking MPI_Allreduce with a dead peer waits
forever. So each collective is started non-blocking (Iallreduce, Iallgatherv, Ibcast) and waited
for by polling Test(), spinning for a few milliseconds (the ranks of one step arrive within that)
and then napping, until one of two things ends the wait:
  - a rank died: MPICH's launcher started with -disable-auto-cleanup (npqwen's launcher does) tells
    every other process of the job so with SIGUSR1; the handler below notes it, and the wait ends
    at once;
  - it took longer than `timeout` seconds (NPQWEN_TP_TIMEOUT, default 60): a rank is stuck, or its
    death went unsignalled (another launcher).
The wait then raises GroupFailed, an NpqwenError that says what was waited for, and the
communicator stays failed: the caller can still answer its open requests with an error, and at
exit the group ends with MPI_Abort (an atexit handler), which stops every rank. A wait for rank 0's
next step (`patient=True`: a server may be idle for hours) has no deadline; only a death ends it.

CUDA would take NCCL instead of MPI, through CuPy (`cupy.cuda.nccl`): rank 0 makes an id with
`nccl.get_unique_id()` and broadcasts it over MPI; every rank makes
`nccl.NcclCommunicator(size, id, rank)`; all_reduce is `comm.allReduce(x.data.ptr, x.data.ptr,
x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)`, all_gather `comm.allGather(...)` into a
(size, ...) buffer (equal shards: pad the vocabulary to a multiple of size), broadcast stays on
MPI (it carries Python objects). NCCL calls are asynchronous on a stream, so the deadline is the
same loop over `cupy.cuda.Event.query()`, and the way out is `comm.abort()`. Until then
tensor parallelism runs on the CPU.
"""
import atexit
import itertools
import os
import pickle
import signal
import threading
import time

import weakref

import numpy as np

from .errors import NpqwenError

DEFAULT_TIMEOUT = 60.0   # seconds a collective of a step may wait for the other ranks
SPIN_SECONDS = 0.005     # poll without sleeping this long first: the ranks of a step arrive within it
MAX_NAP = 0.01           # then sleep between polls, longer the longer it waits, up to this


class GroupFailed(NpqwenError):
    """A rank of the tensor-parallel group died, is stuck, or failed: the group cannot go on."""


class SingleProcess:
    """The communicator of one process: nothing to meet, every collective returns its input."""
    size, rank = 1, 0

    def all_reduce(self, x):
        return x

    def all_gather(self, x, axis: int = -1, patient: bool = False):
        return x

    def broadcast(self, obj=None, patient: bool = False):
        return obj


class MPICommunicator:
    """The collectives over MPI on NumPy buffers, each with a deadline (see the module docstring)."""

    def __init__(self, timeout: float | None = None):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise NpqwenError(f"tensor parallelism needs mpi4py and an MPI: pip install 'npqwen[distributed]' "
                              f"({e})") from None
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()      # our own: a user's MPI traffic never mixes with the model's
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.timeout = timeout if timeout is not None else float(os.environ.get("NPQWEN_TP_TIMEOUT",
                                                                                DEFAULT_TIMEOUT))
        self.failed: str | None = None        # why the group ended, once it has
        self.seconds_waited, self.collectives = 0.0, 0   # time in collectives (the benchmark's "communication")
        self.peer_died = False                # set by SIGUSR1 from MPICH's launcher
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_peer_death)
        self.when_peer_dies = None            # called (in the main thread) when SIGUSR1 comes; a server stops
        atexit.register(self._at_exit)
        # Kept for npqwen/parallel.py, which runs the model on this group: how deep rank 0 is in calls it
        # leads, whether this rank is following rank 0's forward passes, and the KV caches for rank 0's.
        self.leading, self.following = 0, False
        self.caches: dict = {}                 # a follower's KV caches, by rank 0's key
        self.kv_keys = weakref.WeakKeyDictionary()   # rank 0: its KV caches' keys
        self.kv_counter, self.freed = itertools.count(), []   # rank 0: the next key; caches let go of since

    def all_reduce(self, x):
        """x (a C-contiguous float array) summed over the ranks, in place; returns x."""
        self.wait(self.comm.Iallreduce(self.MPI.IN_PLACE, x, op=self.MPI.SUM), "an all-reduce")
        return x

    def all_gather(self, x, axis: int = -1, patient: bool = False):
        """Every rank's x (C-contiguous) side by side along the last axis (sizes along it may differ
        between ranks), or stacked along axis 0. `patient`: no deadline for the ranks to come (after
        loading, one may be much later than another)."""
        sizes = np.empty(self.size, dtype=np.int64)                                    # bytes from each rank
        self.wait(self.comm.Iallgather(np.array([x.nbytes], dtype=np.int64), sizes), "an all-gather", patient)
        received = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.wait(self.comm.Iallgatherv(x.reshape(-1).view(np.uint8), [received, (sizes, offsets), self.MPI.BYTE]),
                  "an all-gather")
        if axis == 0:   # rank by rank, one after the other: already in place
            return received.view(x.dtype).reshape(-1, *x.shape[1:])
        rows = int(np.prod(x.shape[:-1]))
        parts = [received[o:o + n].view(x.dtype).reshape(*x.shape[:-1], n // x.itemsize // max(rows, 1))
                 for o, n in zip(offsets.tolist(), sizes.tolist())]
        return np.concatenate(parts, axis=-1)

    def broadcast(self, obj=None, patient: bool = False):
        """Rank 0's obj on every rank (pickled: a length, then the bytes). `patient`: no deadline for
        the first part, for a rank that waits for rank 0's next step."""
        length = np.zeros(1, dtype=np.int64)
        if self.rank == 0:
            data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            length[0] = data.size
        self.wait(self.comm.Ibcast(length, root=0), "rank 0's next step", patient)
        if self.rank != 0:
            data = np.empty(int(length[0]), dtype=np.uint8)
        self.wait(self.comm.Ibcast(data, root=0), "a broadcast from rank 0")
        return obj if self.rank == 0 else pickle.loads(data.tobytes())

    def wait(self, request, what: str, patient: bool = False):
        """Poll a non-blocking collective until it is done; GroupFailed if a rank died or, unless
        `patient`, the timeout passed."""
        timeout = None if patient else self.timeout
        if self.failed:
            raise GroupFailed(self.failed)
        start = time.monotonic()
        self.collectives += 1
        # A rank's death is checked before each poll, not only while one fails: a collective can complete
        # without a dead peer (rank 0's small broadcast is sent eagerly), and then MPI_Finalize would wait for it.
        while self.peer_died or not request.Test():
            waited = time.monotonic() - start
            if self.peer_died:
                self.fail(f"tensor parallel: a rank of the group stopped (it exited or was killed) while this "
                          f"rank ({self.rank}) waited for {what}")
            if timeout is not None and waited > timeout:
                self.fail(f"tensor parallel: rank {self.rank} waited {timeout:g} s for {what} and the other ranks "
                          f"never came; one is stuck or gone (NPQWEN_TP_TIMEOUT sets the limit)")
            if waited > SPIN_SECONDS:
                time.sleep(min(MAX_NAP, waited / 10))
        self.seconds_waited += time.monotonic() - start

    def fail(self, message: str):
        """The group cannot go on: remember why (every later collective fails at once) and raise it."""
        self.failed = message
        raise GroupFailed(message)

    def abort(self, code: int = 1):
        """End every rank of the group now (MPI_Abort); the launcher exits with `code`."""
        self.comm.Abort(code)

    def _on_peer_death(self, signum, frame):
        self.peer_died = True
        if self.when_peer_dies is not None:
            self.when_peer_dies()

    def _at_exit(self):
        """A failed group ends with MPI_Abort. Otherwise the ranks leave one by one, and MPICH's
        SIGUSR1 about a rank that left must not kill one still finishing (Python gives SIGUSR1 back
        its default action, which is to die, while it shuts down; an ignored signal stays ignored)."""
        if self.failed:
            self.abort(1)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
