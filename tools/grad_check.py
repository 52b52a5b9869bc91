"""npqwen's gradients against HF transformers' .backward() at a real shape, in float32 (tests/test_backward.py
does the same at a tiny shape, in float32 and float64, in every test run).

    python tools/grad_check.py                   # Qwen3-0.6B's shape, 2 layers, full vocabulary
    python tools/grad_check.py --layers 4 --tokens 32

Random weights (std 0.02, norms 1 + noise), saved by transformers in float32 to a temporary directory; the
objective is log p of a token at the last position. Prints the largest relative difference (max |diff| /
max |HF|) over every parameter and every activation HF has a module for, and each side's time.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import npqwen  # noqa: E402
from npqwen import grad  # noqa: E402
from npqwen.config import QWEN3_0_6B_CONFIG  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    from conftest import build_hf_checkpoint, hf_model
    from test_backward import hf_gradients, rel

    config = dict(QWEN3_0_6B_CONFIG, num_hidden_layers=args.layers)
    ids = np.random.default_rng(0).integers(0, 150000, args.tokens).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_hf_checkpoint(Path(tmp), config, save_dtype="float32", std=0.02)
        hf = hf_model(path)   # HF first, its gradients kept as NumPy arrays, then npqwen: one model at a time
        start = time.perf_counter()
        value, params, activations = hf_gradients(hf, ids, 42)
        hf_s = time.perf_counter() - start
        del hf
        llm = npqwen.load(path)
        start = time.perf_counter()
        ours = grad.gradients(llm, ids, grad.log_prob(42))
        npqwen_s = time.perf_counter() - start
    worst = sorted([(rel(ours[n], g), n) for n, g in params.items()] +
                   [(rel(np.reshape(ours[n], g.shape), g), n) for n, g in activations.items() if n in ours],
                   reverse=True)
    print(f"Qwen3-0.6B shape, {args.layers} layers, {args.tokens} tokens, float32: log p {ours.value:.7f} "
          f"(HF {value:.7f}); {len(params)} parameters and {sum(n in ours for n in activations)} activations "
          f"compared; largest relative differences {worst[:3]}; forward+backward npqwen {npqwen_s:.2f} s, "
          f"HF {hf_s:.2f} s")
    return 0 if worst[0][0] < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
