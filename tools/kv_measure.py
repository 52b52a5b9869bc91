"""--kv-cache-dtype and --prefix-cache-dir at the Qwen3-0.6B shape, measured (the figures in docs/engine.md).

    python tools/kv_measure.py error [--layers 28] [--tokens 512]
    python tools/kv_measure.py rss --kv-cache-dtype auto [--layers 4] [--tokens 16384]

`error`: each compact KV dtype's logits against float32 keys and values (the same float32 weights), over a text
of --tokens tokens (docs/engine.md, with the real tokenizer): the largest |difference| relative to the row's
largest |logit|, the mean KL(float32 || dtype) of the next-token distributions, and top-1 agreement. Random
weights give a flat next-token distribution, so top-1 flips more easily than in a trained model.
`rss`: one process loads a random checkpoint of the 0.6B shape with --layers of its 28 layers (the whole
vocabulary), makes an Engine with the default pool, and reads a --tokens-token prompt to its first token: its peak
RSS against the weights + the KV it holds (+ 0.5 GB); then, with the same --prefix-cache-dir, a second
process (a restart) reads the same prompt from the files: both first-token times.
Checkpoints are written once into .cache/kv-measure.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CACHE = ROOT / ".cache" / "kv-measure"


def checkpoint(layers: int) -> Path:
    path = CACHE / f"qwen3-0.6b-shape-{layers}-layers"
    if not (path / "model.safetensors").is_file():
        from conftest import (
            QWEN3_0_6B,
            QWEN3_TOKENIZER_DIR,
            add_qwen3_tokenizer,
            write_npqwen_checkpoint,
        )

        write_npqwen_checkpoint(path, {**QWEN3_0_6B, "num_hidden_layers": layers}, dtype="BF16")
        if (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
            add_qwen3_tokenizer(path)
    return path


def error(args):
    import npqwen
    from npqwen.kv_cache import KV_CACHE_DTYPES, Batch, KVCache

    llm = npqwen.load(checkpoint(args.layers))
    ids = llm.tokenizer.encode((ROOT / "docs" / "engine.md").read_text())[:args.tokens]
    T, P = len(ids), 256

    def logits(kv_dtype):
        kv = KVCache(llm.config, -(-T // P), P, np, np.float32, kv_dtype=kv_dtype)
        batch = Batch(np.array(ids), [0], [T], [np.arange(kv.num_pages)], P, sample_rows=np.arange(T))
        return llm.model.forward_batch(batch, kv).logits                     # (T, V) float32

    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref = logits("auto")
    rows = {}
    for kv_dtype in KV_CACHE_DTYPES[1:]:
        out = logits(kv_dtype)
        rel = (np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max()
        kl = np.mean([(np.exp(p) * (p - log_softmax(out[i:i + 64]))).sum(-1).mean()   # 64 rows at a time
                      for i in range(0, T, 64) for p in [log_softmax(ref[i:i + 64])]])
        top1 = (out.argmax(-1) == ref.argmax(-1)).mean()
        rows[kv_dtype] = {"max_rel_diff": float(rel), "mean_kl": float(kl), "top1_agreement": float(top1)}
        print(f"{kv_dtype:12s} logits max rel diff {rel:.2e}  mean KL {kl:.2e}  top-1 agreement {top1:.2%} "
              f"over {T} tokens, {args.layers} layers", flush=True)
    print(json.dumps(rows))


def first_token(args):
    """One process: load, the default engine, the prompt to its first token; what it measured as JSON."""
    import npqwen
    from npqwen import Engine
    from npqwen.kv_cache import KVCache

    llm = npqwen.load(checkpoint(args.layers))
    tied = llm.config.tie_word_embeddings   # lm_head is embed_tokens then; q/k/v and gate/up are views of fused ones
    weights = sum(w.nbytes for name, w in llm.model.weights.items() if not (tied and name == "lm_head.weight"))
    loaded = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:   # the peak (VmHWM) starts again from here: the prompt's own
        f.write("5")
    engine = Engine(llm, kv_cache_dtype=args.kv_cache_dtype, prefix_cache_dir=args.prefix_cache_dir)
    ids = np.random.default_rng(0).integers(0, llm.config.vocab_size, args.tokens).tolist()
    start = time.perf_counter()
    engine.add_request(ids, max_new_tokens=1, temperature=0)
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    kv = args.tokens * KVCache.bytes_per_token(llm.config, llm.model.dtype, args.kv_cache_dtype)
    print(json.dumps({"seconds": seconds, "peak_rss": status_bytes("VmHWM"),
                      "rss_after_load": loaded, "weights": weights, "kv_held": kv,
                      "pool_positions": engine.pool.num_pages * engine.page_size,
                      "pages_read": engine.cache.disk.loaded_pages if engine.cache.disk else 0}))


def status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: the peak since clear_refs)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss(args):
    import shutil

    folder = CACHE / f"pages-{args.kv_cache_dtype}"
    shutil.rmtree(folder, ignore_errors=True)
    checkpoint(args.layers)
    runs = []
    for _ in ("first start", "restart"):
        out = subprocess.run([sys.executable, __file__, "first-token", "--layers", str(args.layers), "--tokens",
                              str(args.tokens), "--kv-cache-dtype", args.kv_cache_dtype, "--prefix-cache-dir",
                              str(folder)], capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    cold, warm = runs
    gb = 1e9
    bound = cold["weights"] + cold["kv_held"] + 0.5 * gb
    print(f"{args.tokens} tokens, {args.layers} layers, KV {args.kv_cache_dtype}: peak RSS {cold['peak_rss'] / gb:.2f} GB "
          f"(after load {cold['rss_after_load'] / gb:.2f}, then the peak measured afresh); weights {cold['weights'] / gb:.2f} + KV held "
          f"{cold['kv_held'] / gb:.2f} + 0.5 = {bound / gb:.2f} GB; default pool {cold['pool_positions']} positions; "
          f"first token {cold['seconds']:.1f} s, after a restart {warm['seconds']:.2f} s "
          f"({cold['seconds'] / warm['seconds']:.0f}x, {warm['pages_read']} pages read)", flush=True)
    print(json.dumps({"first_start": cold, "restart": warm}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["error", "rss", "first-token"])
    p.add_argument("--layers", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--prefix-cache-dir")
    args = p.parse_args()
    args.layers = args.layers or (28 if args.what == "error" else 4)
    args.tokens = args.tokens or (512 if args.what == "error" else 16384)
    {"error": error, "rss": rss, "first-token": first_token}[args.what](args)


if __name__ == "__main__":
    main()
