"""The array module: NumPy on device "cpu", CuPy on device "cuda". Chosen here and nowhere else.

Model code receives arrays and asks `xp_of(array)` for the module that owns them, so the
same operator runs on both devices and never branches on the device itself.
"""
import sys

import numpy as np

from .errors import NpqwenError

DEVICES = ("cpu", "cuda")


def array_module(device: str):
    """NumPy for "cpu"; CuPy for "cuda", imported only when asked for."""
    if device == "cpu":
        return np
    if device != "cuda":
        raise NpqwenError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    try:
        import cupy
    except ImportError as e:
        raise NpqwenError("device 'cuda' needs CuPy: pip install 'npqwen[gpu]' "
                          "(or the cupy-cudaXXx wheel that matches your CUDA)") from e
    try:
        n_gpus = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise NpqwenError(f"device 'cuda': CuPy is installed but CUDA is not usable ({e})") from e
    if n_gpus == 0:
        raise NpqwenError("device 'cuda': CuPy is installed but no GPU is visible")
    return cupy


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    try:
        array_module("cuda")
    except NpqwenError:
        return False
    return True


def xp_of(a):
    """The module (numpy or cupy) that owns array `a`; a CuPy array implies cupy is imported."""
    return np if isinstance(a, np.ndarray) else sys.modules["cupy"]


def to_numpy(a) -> np.ndarray:
    """Copy a device array to the host (no copy for a NumPy array)."""
    return a if isinstance(a, np.ndarray) else a.get()


def free_memory_bytes(xp) -> int:
    """Memory free for new arrays: the GPU's free memory under CuPy, else the host's MemAvailable."""
    if xp is not np:
        return int(xp.cuda.runtime.memGetInfo()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")   # no /proc (macOS): free pages
