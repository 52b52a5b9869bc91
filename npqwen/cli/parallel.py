"""`npqwen generate|chat|serve --tensor-parallel-size N`: the same command over N processes.

Asked for on the command line, npqwen checks N against the model (before anything loads) and starts
itself again under mpiexec with N ranks on this machine, OPENBLAS_NUM_THREADS = cores / N each unless
it is set. Started by mpiexec (this machine or several: `mpiexec -hosts a,b -n 2 npqwen serve ...`),
every rank runs main(): rank 0 runs the command itself, leading for the whole run (npqwen/parallel.py);
each other rank loads its part when rank 0 loads, runs rank 0's forward passes, and exits when rank 0
says its exit code, printing nothing of its own unless rank 0 is gone. A failure that leaves the ranks
out of step (a rank died or is stuck, an exception inside a step) ends the group with MPI_Abort.
"""
import os
import shutil
import signal
import sys
from pathlib import Path

from ..errors import NpqwenError

COMMANDS = ("generate", "chat", "serve")   # the ones that run tensor parallel
# How MPICH's launcher (hydra) starts the ranks so that one that dies does not take the others with it
# at once (rank 0 must still answer its open requests with an error): -disable-auto-cleanup, after
# which hydra tells the others with SIGUSR1 (npqwen/comm.py); and each rank under a shell that ignores
# SIGUSR1 and SIGINT and exits with the rank's status, because hydra kills every rank (SIGKILL) as
# soon as a process it started dies of a signal, whatever the flag says (MPICH 4-5, proxy/pmip.c). The
# rank itself handles both signals (rank 0 takes Ctrl-C back, see start()).
FAULT_TOLERANT, RANK_SHELL = ["-disable-auto-cleanup"], ["sh", "-c", 'trap "" USR1 INT; "$@"', "npqwen-rank"]


def add_option(p):
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="split the model over N processes on this machine (mpiexec; needs npqwen[distributed]); "
                        "under mpiexec, one rank per process it started (default: 1)")


def mpi_world_size() -> int:
    """How many ranks the MPI launcher that started this process started (0: none), from its environment."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def first_rank() -> bool:
    """Rank 0 of the launcher's ranks, or no launcher at all."""
    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0"


def wanted(args) -> bool:
    """Does this command run tensor parallel: asked for with N > 1, or started by mpiexec with several ranks?"""
    n = getattr(args, "tensor_parallel_size", None)
    if n is not None and n < 1:
        raise NpqwenError(f"--tensor-parallel-size must be >= 1, got {n}")
    return (n or 1) > 1 or mpi_world_size() > 1


def relaunch(args, argv: list[str]):
    """Not under mpiexec yet: check N, then run `mpiexec -n N python -m npqwen ARGS` beside it (supervise) and
    exit with its status (never returns)."""
    n = args.tensor_parallel_size
    check_model_split(args.model, n)
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        raise NpqwenError("--tensor-parallel-size needs mpi4py and an MPI: pip install 'npqwen[distributed]'")
    mpiexec = find_mpiexec()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, cores // n)))
    hydra = is_hydra(mpiexec)
    command = [mpiexec, *(FAULT_TOLERANT if hydra else []), "-n", str(n), *(RANK_SHELL if hydra else []),
               sys.executable, "-m", "npqwen", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(supervise(command))


# How long the group has to stop by itself after a SIGTERM, SIGHUP or `kill -INT` to the launcher, before
# every process of it is killed.
GRACE_S = 5.0
GROUP_MARK = "NPQWEN_TP_GROUP"   # in the environment of every process of the group, whatever its session
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def supervise(command: list[str]) -> int:
    """Run mpiexec and stay beside it, so that the group ends as one. mpiexec starts each rank in a
    session of its own, so a signal to the launcher reaches only part of the group: here a SIGTERM,
    SIGHUP or `kill -INT` becomes the Ctrl-C the ranks stop on (rank 0 ends the command, the others
    follow), and whatever of the group is still running GRACE_S later, or once mpiexec has exited,
    is killed. Ctrl-C from the terminal reaches mpiexec itself (it shares our process group, as chat's
    input needs), so it is left to it. Every process of the group carries GROUP_MARK in its environment."""
    import secrets
    import subprocess
    import time

    mark = os.environ[GROUP_MARK] = f"{os.getpid()}-{secrets.token_hex(4)}"
    watched = {*STOP_SIGNALS, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)   # taken one at a time below, with who sent them
    launcher = subprocess.Popen(command, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, watched))
    deadline, stopped_by = None, None
    while launcher.poll() is None:
        timeout = 1.0 if deadline is None else max(0.01, deadline - time.monotonic())
        info = signal.sigtimedwait(watched, timeout)
        if info is not None and info.si_signo in STOP_SIGNALS and not from_the_terminal(info):
            stopped_by = stopped_by or info.si_signo
            deadline = deadline or time.monotonic() + GRACE_S
            launcher.send_signal(signal.SIGINT)   # the first: the ranks stop; a second one: hydra kills them
        if deadline is not None and time.monotonic() >= deadline:
            launcher.kill()
            launcher.wait()
    kill_group(mark)   # an orphaned rank or proxy, in a session of its own
    code = launcher.returncode
    if stopped_by:
        return 128 + stopped_by if code else 0
    if code > 128 and code != 128 + signal.SIGINT:   # a rank died of a signal (kill -9, the OOM killer) and the
        return 1                                      # others ended the group (MPI_Abort): the group's failure, 1
    return code if code >= 0 else 128 - code          # mpiexec itself killed: 128 + the signal, as a shell says


def from_the_terminal(info) -> bool:
    """A Ctrl-C typed on the terminal (the kernel sends it to the whole foreground process group, mpiexec
    included), not a `kill` from a process."""
    return info.si_signo == signal.SIGINT and info.si_code > 0   # SI_KERNEL; kill() is SI_USER (0)


def group_pids(mark: str) -> list[int]:
    """The processes (not zombies) whose environment carries `mark`, this one aside: read from /proc."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) == os.getpid() or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if f"{GROUP_MARK}={mark}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                pids.append(int(pid))
        except (OSError, IndexError):   # gone meanwhile, or not ours to read
            pass
    return pids


def kill_group(mark: str):
    """SIGKILL every process left of the group."""
    for pid in group_pids(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def check_model_split(model: str, n: int):
    """The model's heads must split over n ranks: read its config.json (no weights) and check."""
    from ..config import Qwen3Config
    from ..parallel import check_split

    from ..tiny import BUILTIN

    if model in BUILTIN:
        config = Qwen3Config.from_dict(BUILTIN[model], source=f"{model} model")
    else:
        from ..hub import resolve_model
        config = Qwen3Config.from_json(resolve_model(model) / "config.json")
    check_split(config, n)


def find_mpiexec() -> str:
    """NPQWEN_MPIEXEC, else the mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    chosen = os.environ.get("NPQWEN_MPIEXEC")
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise NpqwenError(f"NPQWEN_MPIEXEC is {chosen!r}, which is not an executable file")
        return chosen
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.is_file() else shutil.which("mpiexec")
    if found is None:
        raise NpqwenError("--tensor-parallel-size needs mpiexec, and there is none beside this Python or on PATH: "
                          "pip install 'npqwen[distributed]' (it brings MPICH), or install an MPI")
    return found


def is_hydra(mpiexec: str) -> bool:
    """MPICH's launcher (hydra) takes -disable-auto-cleanup; Open MPI's mpiexec does not."""
    real = os.path.realpath(mpiexec)
    return "hydra" in real or (Path(real).parent / "hydra_pmi_proxy").exists()


def start(args, argv: list[str]):
    """Under mpiexec: this rank's communicator, on args.comm. Rank 0 leads for the whole run."""
    if args.command not in COMMANDS:
        raise NpqwenError(f"npqwen {args.command} runs in one process; under mpiexec only "
                          f"{', '.join(COMMANDS)} run tensor parallel")
    from ..comm import MPICommunicator

    args.comm = comm = MPICommunicator()
    n = args.tensor_parallel_size
    if n is not None and n != comm.size:
        raise NpqwenError(f"--tensor-parallel-size is {n} but mpiexec started {comm.size} ranks; give mpiexec "
                          f"-n {n}, or leave the option out under mpiexec")
    if comm.rank == 0:
        comm.leading = 1
        signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C, even if the launcher's shell ignored it
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle: it says when to stop
    return comm


def share_load(args, model: str):
    """Rank 0, about to load: the other ranks load the same model with it."""
    if getattr(args, "comm", None) is not None:
        args.comm.broadcast(("load", model, args.device, args.dtype, args.weights))


def follow_command(comm) -> int:
    """A rank > 0: load when rank 0 does, run its forward passes, and exit with its exit code."""
    from ..comm import GroupFailed
    from ..llm import load
    from ..parallel import follow

    try:
        kind, *rest = comm.broadcast(patient=True)
        if kind == "stop":
            return rest[0]
        model, device, dtype, weights = rest
        try:
            llm = load(model, device=device, dtype=dtype, tensor_parallel=comm, weights=weights)
        except GroupFailed:
            raise
        except NpqwenError:    # every rank has the same error, and rank 0 prints it; then it says stop
            kind, *rest = comm.broadcast(patient=True)
            return rest[0]
        kind, rest = follow(llm.model)
        return rest[0] if kind == "stop" else 1
    except GroupFailed as e:   # rank 0 is gone, or the group out of step: say so, rank 0 may not
        print(f"npqwen: error: {e}", file=sys.stderr)
        return 1


def watch_server(args, loop, server):
    """npqwen serve, rank 0: a rank that dies (SIGUSR1) or a step that fails ends the engine thread,
    which answers every open request with the error, and then the server."""
    comm = getattr(args, "comm", None)
    if comm is None:
        return

    def stop(*_):
        loop.stop_soon()
        server.should_exit = True
    comm.when_peer_dies = stop
    loop.on_failure = stop


def check_group(args):
    """After the command: if a rank died or the group failed meanwhile, that is its error."""
    from ..comm import GroupFailed

    comm = getattr(args, "comm", None)
    if comm is not None and (comm.failed or comm.peer_died):
        raise GroupFailed(comm.failed or "tensor parallel: a rank of the group stopped (it exited or was killed)")


def finish(args, code: int) -> int:
    """Rank 0 at the end: the other ranks exit with `code`; or, the group out of step, it ends (MPI_Abort)."""
    comm = getattr(args, "comm", None)
    if comm is None or comm.size == 1 or comm.rank != 0:
        return code
    if comm.failed is None and code in (0, 1):   # 1: an NpqwenError, never raised inside a step
        try:
            comm.broadcast(("stop", code))
            return code
        except NpqwenError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    comm.abort(code or 1)
    return code
