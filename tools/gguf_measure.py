"""GGUF formats at the Qwen3-0.6B shape, measured: each format's KL divergence from float32 over a fixed text (llama.cpp's
`--kl-divergence` measure: the mean over positions of KL(float32 || format) of the next-token distributions), top-1
agreement, and with --speed npqwen's and llama.cpp's prefill and decode tokens/s on the same files.

    python tools/gguf_measure.py [--layers 28] [--formats Q8_0,Q4_K_M] [--speed] [--threads 1]

A random checkpoint of Qwen3-0.6B's shape with --layers of its 28 layers (the whole vocabulary and the real
tokenizer) is written once into .cache/gguf-measure, converted by llama.cpp's convert_hf_to_gguf.py to F32 and
quantized by llama.cpp: Q8_0, Q6_K, Q5_K, Q4_K (--pure: every matrix in that one type), Q5_K_M and Q4_K_M (llama.cpp's
mixes), Q4_0. bfloat16 and int8 are npqwen's own conversions of the F32 file while loading (weights=...). npqwen on
the F32 file is the float32 reference.
Random weights give a flat next-token distribution, so the KL measures each format's logit error, not what a
trained model loses. Needs tools/fetch_node_llama_cpp.sh and tools/fetch_qwen3_tokenizer.sh.
"""
import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import llama_cpp  # noqa: E402

LLAMA_CPP = {"Q8_0": ("Q8_0", False), "Q6_K": ("Q6_K", True), "Q5_K": ("Q5_K_S", True), "Q5_K_M": ("Q5_K_M", False),
             "Q4_K": ("Q4_K_S", True), "Q4_K_M": ("Q4_K_M", False), "Q4_0": ("Q4_0", False)}   # (ftype, pure)
NPQWEN = ("bfloat16", "int8")   # converted by npqwen.load from the F32 file
FORMATS = (*NPQWEN, *LLAMA_CPP)
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based ink and a screw press into one system. Within fifty years presses were running in more "
        "than two hundred cities across Europe, and the price of a book fell by a factor of ten. def area(r):\n"
        "    return 3.14159 * r ** 2\nprint(area(2))  # 12.56636\n日本語の文章も少し入れておきます。")


def write_checkpoint(path: Path, layers: int, seed: int = 0):
    """A random Qwen3-0.6B-shape checkpoint (float32, std 0.02, norms 1 + noise) with the real tokenizer files."""
    from npqwen.checkpoint import expected_shapes, save_safetensors
    from npqwen.config import QWEN3_0_6B_CONFIG, Qwen3Config

    config = {**QWEN3_0_6B_CONFIG, "num_hidden_layers": layers, "max_window_layers": layers}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {name: (1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                      else 0.02 * rng.standard_normal(shape)).astype(np.float32)
               for name, shape in expected_shapes(Qwen3Config.from_dict(config)).items()
               if name != "lm_head.weight"}
    save_safetensors(path / "model.safetensors", tensors, "F32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_cpp.ROOT / ".cache" / "qwen3-tokenizer" / name, path / name)


def files(layers: int, formats) -> dict:
    """The F32 file and llama.cpp's quantization of it to each of `formats` (of LLAMA_CPP), each written once."""
    root = llama_cpp.ROOT / ".cache" / "gguf-measure" / f"qwen3-0.6b-shape-{layers}-layers"
    out = {"F32": root / "F32.gguf", **{f: root / f"{f}.gguf" for f in formats if f in LLAMA_CPP}}
    if not out["F32"].is_file():
        shutil.rmtree(root, ignore_errors=True)
        write_checkpoint(root / "hf", layers)
        llama_cpp.convert(root / "hf", out["F32"])
        shutil.rmtree(root / "hf")
    for f, path in out.items():
        if not path.is_file():
            ftype, pure = LLAMA_CPP[f]
            llama_cpp.quantize(out["F32"], path.with_suffix(".tmp"), ftype, pure=pure)
            path.with_suffix(".tmp").rename(path)
    return out


def kl_and_top1(ref_logits, logits):
    """Mean and max over positions of KL(ref || this), and the share of positions whose top token agrees."""
    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    p, q = log_softmax(ref_logits), log_softmax(logits)
    kl = (np.exp(p) * (p - q)).sum(axis=1)
    return kl.mean(), kl.max(), (p.argmax(axis=1) == q.argmax(axis=1)).mean()


def npqwen_speed(llm, prompt_tokens: int, decode_tokens: int) -> dict:
    ids = list(range(1000, 1000 + prompt_tokens))
    llm.generate(ids[:8], 2)   # warm-up
    result = llm.generate(ids, decode_tokens, temperature=0)
    return {"prefill_tps": prompt_tokens / result.prefill_seconds,
            "decode_tps": (len(result.token_ids) - 1) / result.decode_seconds}


def llama_cpp_speed(path: Path, threads: int, prompt_tokens: int, decode_tokens: int) -> dict:
    result = subprocess.run(["node", str(llama_cpp.ROOT / "tools" / "llama_cpp_speed.mjs"), str(llama_cpp.NODE_LLAMA_CPP),
                             str(path), str(threads), str(prompt_tokens), str(decode_tokens)],
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="decoder layers of the 0.6B shape (of 28)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of " + ", ".join(FORMATS))
    p.add_argument("--speed", action="store_true", help="also prefill and decode tokens/s, npqwen and llama.cpp")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (npqwen) and llama.cpp threads")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32)
    args = p.parse_args(argv)

    from threadpoolctl import threadpool_limits

    import npqwen
    from npqwen.weights import total_bytes

    threadpool_limits(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    paths = files(args.layers, formats)
    ref = npqwen.load(paths["F32"])
    ids = ref.tokenizer.encode(TEXT)
    ref_logits = ref.forward(ids)
    rows = []
    for f in ("F32", *formats):
        started = time.perf_counter()
        llm = ref if f == "F32" else npqwen.load(paths["F32"], weights=f) if f in NPQWEN else npqwen.load(paths[f])
        kl_mean, kl_max, top1 = kl_and_top1(ref_logits, llm.forward(ids))
        row = {"format": f, "weights_MiB": total_bytes(llm.model.weights) / 2**20, "kl_mean": kl_mean,
               "kl_max": kl_max, "top1": top1, "seconds": time.perf_counter() - started}
        if args.speed and f in paths:
            ours = npqwen_speed(llm, args.prompt_tokens, args.decode_tokens)
            theirs = llama_cpp_speed(paths[f], args.threads, args.prompt_tokens, args.decode_tokens)
            row.update({f"npqwen_{k}": v for k, v in ours.items()}, **{f"llama_cpp_{k}": v for k, v in theirs.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
    print(f"\nQwen3-0.6B shape, {args.layers} of 28 layers, random weights; {len(ids)} positions; "
          f"{time.strftime('%Y-%m-%d')}\n")
    head = "| format | weights MiB | KL mean | KL max | top-1 |" + (" npqwen prefill / decode tok/s | llama.cpp "
                                                                 "prefill / decode tok/s | decode ratio |" if args.speed else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        line = f"| {r['format']} | {r['weights_MiB']:.0f} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['top1']:.3f} |"
        if "npqwen_decode_tps" in r:
            line += (f" {r['npqwen_prefill_tps']:.0f} / {r['npqwen_decode_tps']:.1f} | {r['llama_cpp_prefill_tps']:.0f} / "
                     f"{r['llama_cpp_decode_tps']:.1f} | {r['npqwen_decode_tps'] / r['llama_cpp_decode_tps']:.2f} |")
        print(line)


if __name__ == "__main__":
    main()
