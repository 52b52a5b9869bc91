"""The machine, measured on the spot: float32 matmul rate, streaming bandwidth (on a GPU: its own
bandwidth and matrix rate), peak RSS, and the FLOPs a workload needs, which those rates turn into bounds."""
import math
import os
import time
from pathlib import Path

from npqwen.cli.common import peak_rss_bytes  # noqa: F401  (this process's own peak: VmHWM; the suites use it)


def machine(args) -> dict:
    import platform

    import numpy as np

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads, "python": platform.python_version(),
            "numpy": np.__version__, "device": args.device, "dtype": args.dtype}


def merge_machine(machine: dict, measured: dict):
    """Add a worker's measurements of the machine; a figure measured twice keeps its best."""
    for k, v in measured.items():
        machine[k] = max(machine.get(k, v), v)


def measure_matmul(weights: dict) -> float:
    """float32 matmul throughput (GFLOP/s): the best of 3 runs of x @ W.T, x of 1024 rows, for
    layer 0's four matmul shapes, using the model's own weights (nothing large is allocated)."""
    import numpy as np

    flops, seconds = 0, 0.0
    mlp = "mlp" if "model.layers.0.mlp.gate_proj.weight" in weights else "mlp.experts.0"   # Qwen3-MoE: an expert's
    attn = ("self_attn.q_proj", "self_attn.o_proj") if "model.layers.0.self_attn.q_proj.weight" in weights \
        else ("linear_attn.in_proj_qkv", "linear_attn.out_proj")                        # Qwen3.5: a linear layer
    for name in (*attn, f"{mlp}.gate_proj", f"{mlp}.down_proj"):
        w = weights[f"model.layers.0.{name}.weight"]
        a = np.ones((1024, w.shape[1]), w.dtype)
        seconds += best_time(lambda: a @ w.T, 3)
        flops += 2 * 1024 * w.shape[0] * w.shape[1]
    return flops / seconds / 1e9


def bandwidth_probe(weights: dict):
    """A function that streams lm_head.weight (622 MB in Qwen3-0.6B) through a BLAS matrix-vector
    product, the fastest read NumPy does here, and returns the GB/s it achieved."""
    import numpy as np

    big = weights["lm_head.weight"]
    x = np.ones(big.shape[1], big.dtype)

    def probe() -> float:
        started = time.perf_counter()
        big @ x
        return big.nbytes / (time.perf_counter() - started) / 1e9
    return probe


def measure_device(xp, dtype) -> dict:
    """A GPU's own limits, measured with CuPy (xp): its memory bandwidth by a device-to-device copy
    (bytes read plus bytes written), and its matrix rate by a square product in the compute dtype.
    Each doubles its size until one run takes 20 ms or it reaches its cap (4 GiB copied, 8192 x 8192:
    a GPU gets there in well under 20 ms; the dry run's stand-in, on the CPU, stops at once); then
    the mean of 10 runs counts (2 of those that took 20 ms)."""
    def seconds_per_run(run, n):
        """Mean time of n runs of `run` (it returns an array), from an idle GPU to its last result."""
        float(run()[0, 0])   # a warm-up, and a wait: reading one element back returns once the work is done
        started = time.perf_counter()
        for _ in range(n):
            last = run()
        float(last[0, 0])
        return (time.perf_counter() - started) / n

    rows = 1 << 12                                             # the copy: (rows, 4096) elements
    while True:
        src, dst = xp.ones((rows, 4096), dtype=dtype), xp.empty((rows, 4096), dtype=dtype)

        def copy():
            dst[...] = src
            return dst
        once = seconds_per_run(copy, 1)
        if 2 * src.nbytes >= 4 << 30 or once >= 0.02:
            break
        rows *= 2
    copied = 2 * src.nbytes
    bandwidth = copied / seconds_per_run(copy, 10 if once < 0.02 else 2) / 1e9
    src = dst = None                                           # freed before the product
    n = 256                                                    # the product: (n, n) @ (n, n)
    while True:
        a = xp.ones((n, n), dtype=dtype)
        once = seconds_per_run(lambda: a @ a, 1)
        if n >= 8192 or once >= 0.02:
            break
        n *= 2
    matmul = 2 * n ** 3 / seconds_per_run(lambda: a @ a, 10 if once < 0.02 else 2) / 1e9
    return {"bandwidth_GBps": bandwidth, "matmul_GFLOPs": matmul, "copy_bytes": copied, "matmul_size": n}



def best_time(fn, n) -> float:
    """The shortest of n timed runs, after one untimed warm-up run."""
    fn()
    best = math.inf
    for _ in range(max(n, 1)):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------- the work

def linear_params_per_token(c) -> int:
    """Weights each token multiplies in the layers: q/k/v/o and gate/up/down of every layer."""
    D, F, H, K, Dh = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    return c.num_hidden_layers * (D * (H + 2 * K) * Dh + H * Dh * D + 3 * D * F)


def prefill_flops(checkpoint, T) -> float:
    """Multiply-adds x 2 of a T-token prefill: every layer's matmuls, causal attention, one lm_head row."""
    from npqwen.config import Qwen3Config

    c = Qwen3Config.from_json(Path(checkpoint) / "config.json")
    H, Dh = c.num_attention_heads, c.head_dim
    attention = c.num_hidden_layers * H * Dh * 2 * (T * (T + 1) / 2)   # q k^T and p v over the causal triangle
    return 2 * (linear_params_per_token(c) * T + attention + c.hidden_size * c.vocab_size)


def linear_flops(checkpoint, tokens, sampled) -> float:
    """Multiply-adds x 2 of the linear layers alone: `tokens` through every layer, `sampled` lm_head rows
    (attention is left out, so the time these take at the float32 matmul rate is a lower bound)."""
    from npqwen.config import Qwen3Config

    c = Qwen3Config.from_json(Path(checkpoint) / "config.json")
    return 2 * (linear_params_per_token(c) * tokens + c.hidden_size * c.vocab_size * sampled)
