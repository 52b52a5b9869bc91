"""npqwen's gradients against HF transformers' .backward() at a real shape, in float32 (tests/test_backward.py
does the same at a tiny shape, in float32 and float64, in every test run).

    python tools/grad_check.py                   # Qwen3-0.6B's shape, 2 layers, full vocabulary
    python tools/grad_check.py --layers 4 --tokens 32
    python tools/grad_check.py --hybrid          # Qwen3.5-0.8B's layers (3 Gated DeltaNet, 1 full attention)
    python tools/grad_check.py --qwen4-exp       # Qwen4-Exp's layers at full width (tests/test_qwen4_exp.py's REAL)

--qwen4-exp: two layers at the real model's width (Gated DeltaNet with PLE, then QSA; C=4 streams at rank 320;
4 experts of the real shape; the vocabulary cut to 2048), 155M parameters: HF's float32 gradients, then npqwen's
in float64 (the exact ones, kept as float32) and in float32; each side's float32 against them and against each
other. 4.2 GB at its peak (HF's model, its gradients and their NumPy copies; one model at a time), under a
minute. Measured (32 tokens): every weight's gradient within 6.7e-6 of HF's; from float64's, npqwen's within 1.1e-5
and HF's within 1.5e-5 (both at PLE's).

--hybrid asks where Qwen3.5's float32 gradients' distance from HF's float32 ones comes from: npqwen and HF
in float64 (HF's float32 casts made float64, as tests/test_backward.py does), each side's float32 against
that, HF's two forms of the delta rule (chunked, recurrent) against each other in float32, and how far the
float64 gradients move when every weight moves by half a float32 ulp (what a float32 computation cannot
avoid). Its vocabulary is cut to 32768; even so it peaks at 6.8 GB (HF's model with three sets of gradients,
and npqwen's float64 model with two), about 3 minutes.

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
    parser.add_argument("--hybrid", action="store_true", help="Qwen3.5-0.8B's layer shapes, float32 and float64")
    parser.add_argument("--qwen4-exp", action="store_true", help="Qwen4-Exp's layers at full width, float32")
    args = parser.parse_args()
    if args.hybrid:
        return hybrid(args)
    if args.qwen4_exp:
        return qwen4_exp(args)
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


def hybrid(args):
    from hybrid_checkpoints import QWEN3_5_0_8B_TEXT, build_hybrid_checkpoint, hf_hybrid_model
    from test_backward import float64_hf, hf_gradients, rel
    from transformers.models.qwen3_5 import modeling_qwen3_5

    config = {"model_type": "qwen3_5_text", **QWEN3_5_0_8B_TEXT, "num_hidden_layers": 4, "vocab_size": 32768}
    ids = np.random.default_rng(0).integers(0, 32768, args.tokens).tolist()
    target = 42

    def worst(got, want):   # the largest relative difference over every weight, and its name
        return max((rel(got[n], w), n) for n, w in want.items())

    with tempfile.TemporaryDirectory() as tmp:
        path = build_hybrid_checkpoint(Path(tmp), config, std=0.02)
        hf = hf_hybrid_model(path)
        hf32 = hf_gradients(hf, ids, target, gated=True)[1]
        hf.zero_grad(set_to_none=True)
        chunked = modeling_qwen3_5.torch_chunk_gated_delta_rule   # HF's other form of the same rule
        modeling_qwen3_5.torch_chunk_gated_delta_rule = modeling_qwen3_5.torch_recurrent_gated_delta_rule
        hf32_recurrent = hf_gradients(hf, ids, target, gated=True)[1]
        modeling_qwen3_5.torch_chunk_gated_delta_rule = chunked
        hf.zero_grad(set_to_none=True)
        llm64 = npqwen.load(path, dtype="float64")
        with pytest_monkeypatch() as mp:
            hf64 = hf_gradients(float64_hf(hf, llm64, mp, hybrid=True), ids, target, gated=True)[1]
        del hf
        exact = grad.gradients(llm64, ids, grad.log_prob(target))
        exact = {n: exact[n] for n in hf32}
        eps32, rng, seen = float(np.finfo(np.float32).eps), np.random.default_rng(1), []
        for w in llm64.model.weights.values():   # every weight moved by up to half a float32 ulp, once
            if not any(np.shares_memory(w, s) for s in seen):
                w *= 1 + rng.uniform(-eps32 / 2, eps32 / 2, w.shape)
                seen.append(w)
        moved = grad.gradients(llm64, ids, grad.log_prob(target))
        moved = {n: moved[n] for n in hf32}
        del llm64
        ours32 = grad.gradients(npqwen.load(path), ids, grad.log_prob(target))
    print(f"Qwen3.5-0.8B's layer shapes, 4 layers (3 linear), vocabulary 32768, {args.tokens} tokens; the largest "
          f"relative difference over {len(hf32)} weights' gradients:")
    for label, (got, want) in {"npqwen float64 vs HF float64": (exact, hf64),
                               "npqwen float32 vs float64": (ours32, exact),
                               "HF float32 (chunked) vs float64": (hf32, exact),
                               "HF float32 recurrent vs float64": (hf32_recurrent, exact),
                               "HF float32 recurrent vs chunked": (hf32_recurrent, hf32),
                               "npqwen float32 vs HF float32": (ours32, hf32),
                               "float64, weights moved by eps32/2": (moved, exact)}.items():
        print(f"  {label:36s} {worst(got, want)[0]:.1e}  ({worst(got, want)[1]})")
    return 0


def qwen4_exp(args):
    from test_backward import hf_gradients, rel
    from test_qwen4_exp import build_real

    ids = np.random.default_rng(0).integers(0, 2048, args.tokens).tolist()
    target = 42
    with tempfile.TemporaryDirectory() as tmp:
        path, hf = build_real(Path(tmp))
        hf.config._experts_implementation = "eager"
        start = time.perf_counter()
        value, hf32, _ = hf_gradients(hf, ids, target, gated=True)
        hf_s = time.perf_counter() - start
        del hf
        llm = npqwen.load(path, dtype="float64")
        g = grad.gradients(llm, ids, grad.log_prob(target), activations=False)
        exact = {n: g[n].astype(np.float32) for n in hf32 if "ngram_embedding" not in n}   # (rounding: 6e-8)
        del llm, g
        llm = npqwen.load(path)
        start = time.perf_counter()
        g = grad.gradients(llm, ids, grad.log_prob(target), activations=False)
        npqwen_s = time.perf_counter() - start
        ours32 = {n: g[n] for n in exact}
    parts = {"hyper_connection": "hyper-connections", ".ple.": "PLE", "self_attn": "QSA attention",
             "linear_attn": "Gated DeltaNet", ".mlp.": "MoE", "": "embedding, lm_head"}
    print(f"Qwen4-Exp, 2 layers at full width, {args.tokens} tokens, float32: log p {g.value:.7f} (HF {value:.7f}); "
          f"forward+backward npqwen {npqwen_s:.2f} s, HF {hf_s:.2f} s; the largest relative difference of each "
          f"part's weights' gradients (the PLE tables: frozen in npqwen, not compared):")
    for key, label in parts.items():
        names = [n for n in exact if key in n and not any(k in n for k in list(parts)[:list(parts).index(key)])]
        if names:
            a, b, c = (max(rel(x[n], y[n]) for n in names) for x, y in
                       ((ours32, hf32), (ours32, exact), (hf32, exact)))
            print(f"  {label:20s} {len(names):3d} weights: npqwen vs HF {a:.1e}; from float64: npqwen {b:.1e}, "
                  f"HF {c:.1e}")
    return 0


def pytest_monkeypatch():
    from _pytest.monkeypatch import MonkeyPatch
    return MonkeyPatch.context()


if __name__ == "__main__":
    sys.exit(main())
