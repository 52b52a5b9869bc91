"""weights: npqwen's compact weights (docs/weights.md) against its float32, side by side in one process, at the
Qwen3-0.6B shape with --weights-layers of its 28 layers (the whole vocabulary: lm_head is 22% of a token's
bytes): a batch-1 decode step after --weights-context cached positions, a --weights-prefill token prefill,
and one decode step of --weights-batch sequences (the engine's batched step: the widening shared by its rows).
Each figure is the format's speed over float32's (float32's time / the format's), the two taken in turn,
the median of --weights-steps; a shared machine moves both alike. With --weights-memory, each format's peak
RSS in a process of its own at the whole 0.6B shape: after loading, and after a context of --weights-generate
positions (a prompt, then 16 tokens generated). Every checkpoint is random, written once in its own format
(never through float32).

With the engine `llama.cpp` (--engines npqwen,llama.cpp: node-llama-cpp's prebuilt CPU library, which
tools/fetch_node_llama_cpp.sh installs) the same random 0.6B shape with --weights-layers layers is written once
as GGUF files by llama.cpp's own converter and quantizer (tools/gguf_measure.py: Q8_0, Q4_0 and Q4_K_M, which
keeps lm_head and some down_proj in Q6_K), and npqwen and llama.cpp each run every file: a --weights-prefill
token prefill, then --weights-decode tokens decoded, --threads threads each; the figures are npqwen's tokens/s
over llama.cpp's. Where node, the library or the tokenizer files are absent it is skipped, with the reason."""
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

NAME, WORKER, NEEDS = "weights", "single", ()
OWN_MODEL = True      # its worker writes and loads checkpoints of its own, in each format
FORMATS = ("bfloat16", "int8", "q8_0", "q4_0", "q4_k")
DECODE_TARGETS = {"int8": 0.9, "q8_0": 0.9, "bfloat16": 0.6, "q4_0": 0.5, "q4_k": 0.5}
GGUF_FILES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K_M"}   # --weights-formats -> llama.cpp's file of it
TARGETS = [(f"weights_{kind}_{f}_vs_float32", ">=", DECODE_TARGETS[f] if kind == "decode" else 0.85,
            f"{kind}, {f}: speed vs float32") for kind in ("decode", "prefill", "batched") for f in FORMATS]


def add_arguments(p):
    p.add_argument("--weights-formats", default=",".join(FORMATS), help="weights: the formats, comma-separated")
    p.add_argument("--weights-layers", type=int, default=28, help="weights: decoder layers of the 0.6B shape")
    p.add_argument("--weights-context", type=int, default=128, help="weights: cached positions of each sequence")
    p.add_argument("--weights-prefill", type=int, default=512, help="weights: prefill tokens")
    p.add_argument("--weights-batch", type=int, default=32, help="weights: sequences in the batched step")
    p.add_argument("--weights-steps", type=int, default=9, help="weights: steps timed per figure (median)")
    p.add_argument("--weights-memory", action="store_true",
                   help="weights: also each format's peak RSS after load and after a generation (its own process)")
    p.add_argument("--weights-generate", type=int, default=1024, help="weights: the context's positions for the RSS")
    p.add_argument("--weights-memory-8b", action="store_true",
                   help="weights: also Qwen3-8B's real shape in Q4_K and Q8_0, written, measured, deleted, one at a time")
    p.add_argument("--weights-8b-context", type=int, default=1024,
                   help="weights: the 8B shape's context (its last 4 positions generated; 1,024: 5-10 min a format)")
    p.add_argument("--weights-decode", type=int, default=16, help="weights, engine llama.cpp: tokens decoded")


def runs_on(engine, args) -> bool:
    return engine in ("npqwen", "llama.cpp")


# ---------------------------------------------------------------------------- random checkpoints, each format

def random_rows(fmt: str, rows: int, cols: int, rng, std: float = 0.02):
    """A random (rows, cols) matrix stored in `fmt`, of values about `std`, made in its own bytes."""
    import numpy as np

    from npqwen import quants
    from npqwen.weights import GGML, BFloat16, Ggml, Int8, float32_to_bf16_bits

    if fmt == "bfloat16":
        return BFloat16(float32_to_bf16_bits((std * rng.standard_normal((rows, cols))).astype(np.float32)))
    if fmt == "int8":
        return Int8(rng.integers(-127, 128, (rows, cols), dtype=np.int8), np.full(rows, std / 73, np.float32))
    qtype = GGML[fmt]
    block, size = quants.BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)   # random integers and 6-bit scales
    d = {"Q8_0": std / 73, "Q4_0": std / 4.6, "Q4_K": std / 270}[qtype]
    raw[..., 0:2] = np.full((rows, cols // block, 1), d, np.float16).view(np.uint8)
    if qtype == "Q4_K":   # dmin: the mins about half the scales, so the values centre near zero
        raw[..., 2:4] = np.full((rows, cols // block, 1), d * 3.75, np.float16).view(np.uint8)
    return Ggml(qtype, raw.reshape(rows, -1), cols)


def write_random(path: Path, config: dict, fmt: str, seed: int = 0) -> Path:
    """A random checkpoint of `config` whose matrices are stored in `fmt` (as npqwen quantize writes them) and
    the rest in float32, written a tensor at a time: the whole model is never in memory, nor in float32."""
    import numpy as np

    from npqwen.checkpoint import expected_shapes, is_matrix, stored_pieces
    from npqwen.config import Qwen3Config
    from npqwen.weights import kept_format

    path.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(Qwen3Config.from_dict(config))
    rng = np.random.default_rng(seed)

    def make(name, shape):
        if not is_matrix(name):
            return (1 + 0.1 * rng.standard_normal(shape) if "norm" in name else
                    0.02 * rng.standard_normal(shape)).astype(np.float32)
        return random_rows(kept_format(fmt, shape[1]), *shape, rng)

    # the header first: each piece's dtype and bytes, from one small probe of its format
    header, metadata, offset = {}, {}, 0
    for name, shape in shapes.items():
        probe = make(name, (1, *shape[1:])) if len(shape) > 1 else make(name, shape)
        for piece, dtype, a in stored_pieces(name, probe):
            full = (shape[0], *a.shape[1:]) if len(shape) > 1 else a.shape
            nbytes = math.prod(full) * a.itemsize
            header[piece] = {"dtype": dtype, "shape": list(full), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        if getattr(probe, "format", "") in ("Q8_0", "Q4_0", "Q4_K"):
            metadata[name] = probe.format
    header = {"__metadata__": metadata, **header} if metadata else header
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape in shapes.items():
            for _, _, a in stored_pieces(name, make(name, shape)):
                f.write(np.ascontiguousarray(a).data)
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "npqwen",
                                                                                   "weights": fmt}}))
    return path


def checkpoint(fmt: str, layers: int) -> Path:
    """The random 0.6B-shape checkpoint of `layers` layers in `fmt`, written once into the bench's cache."""
    from npqwen.config import QWEN3_0_6B_CONFIG
    from tools.bench.engines import CACHE_DIR

    path = CACHE_DIR / f"qwen3-0.6b-{layers}-layers-{fmt}"
    if not (path / "config.json").is_file():
        config = dict(QWEN3_0_6B_CONFIG, num_hidden_layers=layers, max_window_layers=layers)
        write_random(path.with_name(path.name + ".tmp"), config, "bfloat16" if fmt == "float32" else fmt)
        path.with_name(path.name + ".tmp").rename(path)
    return path


# ---------------------------------------------------------------------------- speed, side by side

def steps(llm, args):
    """(decode, prefill, batched): three functions that each run one step of llm's model."""
    import numpy as np

    from npqwen.kv_cache import Batch, KVCache

    model, cfg, xp, S = llm.model, llm.config, llm.model.xp, args.weights_context
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, max(args.weights_batch, args.weights_prefill))

    def decode_of(B):
        kv = KVCache(cfg, B, S + 1, xp, model.dtype)            # one page of S + 1 positions per sequence
        kv.keys.fill(0.01)
        kv.values.fill(0.01)
        batch = Batch(ids[:B], [S] * B, [1] * B, [np.array([b]) for b in range(B)], S + 1,
                      sample_rows=np.arange(B))
        return lambda: model.forward_batch(batch, kv)

    return decode_of(1), lambda: model.forward(ids[:args.weights_prefill], last_only=True), \
        decode_of(args.weights_batch)


def side_by_side(a, b, n: int) -> tuple[float, float]:
    """The median time of a and of b, run in turn n times after one untimed run of each."""
    times = ([], [])
    a(), b()
    for _ in range(n):
        for k, fn in enumerate((a, b)):
            started = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def run(engine, args, rng) -> dict:
    import npqwen
    from npqwen.weights import total_bytes

    if engine == "llama.cpp":
        return {"weights": against_llama_cpp(args)}
    formats = [f for f in args.weights_formats.split(",") if f]
    L = args.weights_layers
    base = npqwen.load(checkpoint("float32", L), weights="float32")
    reference = steps(base, args)
    out = {"weights_bytes_float32": total_bytes(base.model.weights)}
    for fmt in formats:
        llm = npqwen.load(checkpoint(fmt, L), weights="stored")   # as stored (a bfloat16 file loads as float32 by default)
        out[f"weights_bytes_{fmt}"] = total_bytes(llm.model.weights)
        for kind, ours, theirs in zip(("decode", "prefill", "batched"), steps(llm, args), reference):
            t32, t = side_by_side(theirs, ours, args.weights_steps)
            out[f"weights_{kind}_{fmt}_s"], out[f"weights_{kind}_float32_s"] = t, t32
            out[f"weights_{kind}_{fmt}_vs_float32"] = t32 / t
        del llm
    if args.weights_memory:
        for fmt in ("float32", *formats):
            out.update({f"weights_rss_{k}_{fmt}": v for k, v in memory(fmt, args.weights_generate).items()})
    if args.weights_memory_8b:
        from tools.bench.engines import CACHE_DIR

        for fmt in ("q4_k", "q8_0"):
            got = memory_8b(fmt, args.weights_8b_context, CACHE_DIR, decode=4)
            out.update({f"weights_8b_rss_{k}_{fmt}": v for k, v in got.items()})
    return {"weights": out}


# ---------------------------------------------------------------------------- llama.cpp on the same GGUF files

def llama_cpp_missing() -> str:
    """Why the llama.cpp engine cannot run here; empty where it can."""
    import shutil

    from tools import llama_cpp

    if shutil.which("node") is None:
        return "node is not installed"
    if not (llama_cpp.BINS / "libllama.v0.4.0.so").is_file() or not (llama_cpp.SOURCE / "convert_hf_to_gguf.py").is_file():
        return f"node-llama-cpp is not in {llama_cpp.NODE_LLAMA_CPP} (tools/fetch_node_llama_cpp.sh)"
    if not (llama_cpp.ROOT / ".cache" / "qwen3-tokenizer" / "tokenizer.json").is_file():
        return "the Qwen3 tokenizer files are not in .cache/qwen3-tokenizer (tools/fetch_qwen3_tokenizer.sh)"
    return ""


def against_llama_cpp(args) -> dict:
    """npqwen's prefill and decode tokens/s over llama.cpp's, both on the same GGUF file of each ggml format."""
    from threadpoolctl import threadpool_limits

    import npqwen
    from tools import gguf_measure

    missing = llama_cpp_missing()
    if missing:
        return {"llama_cpp_skipped": missing}
    threadpool_limits(args.threads)
    formats = [f for f in args.weights_formats.split(",") if f in GGUF_FILES]
    paths = gguf_measure.files(args.weights_layers, [GGUF_FILES[f] for f in formats])   # written once: converted, then quantized by llama.cpp
    out = {}
    for fmt in formats:
        path = paths[GGUF_FILES[fmt]]
        llm = npqwen.load(path)
        ours = gguf_measure.npqwen_speed(llm, args.weights_prefill, args.weights_decode)
        del llm
        theirs = gguf_measure.llama_cpp_speed(path, args.threads, args.weights_prefill, args.weights_decode)
        for kind in ("prefill", "decode"):
            out[f"weights_npqwen_gguf_{kind}_{fmt}_tps"] = ours[f"{kind}_tps"]
            out[f"weights_llama_cpp_{kind}_{fmt}_tps"] = theirs[f"{kind}_tps"]
            out[f"weights_{kind}_{fmt}_vs_llama_cpp"] = ours[f"{kind}_tps"] / theirs[f"{kind}_tps"]
    return out


# ---------------------------------------------------------------------------- memory, a process per format

def memory(fmt: str, generate: int, path: Path | None = None, decode: int = 16, chunk: int = 256) -> dict:
    """Peak RSS (bytes) of a process that loads a checkpoint (the whole 0.6B shape in `fmt`) as stored, then
    fills a context of `generate` positions through the engine, its KV cache exactly that long: a prompt of
    generate - decode tokens read in chunks of `chunk`, then `decode` tokens generated greedily; every position's
    keys and values written, as a generation of that length writes them. One BLAS thread: on a loaded machine
    OpenBLAS's threads wait on each other in every small product of paged attention (measured: a 64-token chunk's
    attention 0.03-2.8 s with two threads, 5-26 ms with one; the runs took 16-45 min)."""
    path = path or checkpoint("bfloat16" if fmt == "float32" else fmt, 28)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    code = (f"import json, time, npqwen\nfrom tools.bench.weights import vm_hwm\n"
            f"started = time.perf_counter()\n"
            f"llm = npqwen.load({str(path)!r}, weights={'float32' if fmt == 'float32' else 'stored'!r})\n"
            f"loaded, load_s = vm_hwm(), time.perf_counter() - started\n"
            f"engine = npqwen.Engine(llm, kv_cache_tokens={-(-generate // 256) * 256}, max_batched_tokens={chunk})\n"
            f"req = engine.new_request([(1000 + i % 5000) % {vocab} for i in range({generate - decode})], "
            f"max_new_tokens={decode}, temperature=0)\n"
            f"req.eos_ids = frozenset()   # random weights: run to the length\n"
            f"engine.add(req)\n"
            f"n = 0\nwhile engine.has_unfinished():\n    n += sum(len(o.token_ids) for o in engine.step())\n"
            f"print(json.dumps({{'load': loaded, 'generate': vm_hwm(), 'tokens': n, 'load_s': load_s, "
            f"'generate_s': time.perf_counter() - started - load_s}}))\n")
    root = Path(__file__).resolve().parents[2]
    one_thread = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", **one_thread})
    if result.returncode != 0:
        raise RuntimeError(f"weights memory {fmt}: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, max_window_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rope_theta=1000000)   # Qwen3-8B's config.json where it differs from the 0.6B's


def memory_8b(fmt: str, generate: int, directory: Path, decode: int = 4) -> dict:
    """memory() at Qwen3-8B's real shape (all 36 layers, the whole vocabulary, lm_head untied): a random checkpoint
    written directly in `fmt` into `directory`, measured in a process of its own, then deleted."""
    import shutil

    from npqwen.config import QWEN3_0_6B_CONFIG

    path = directory / f"qwen3-8b-shape-{fmt}"
    try:
        write_random(path, dict(QWEN3_0_6B_CONFIG, **QWEN3_8B), fmt)
        return memory(fmt, generate, path, decode=decode)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def vm_hwm() -> int:
    """This process's peak resident memory in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


# ---------------------------------------------------------------------------- the report

def figures(report) -> dict:
    ours = report["engines"].get("npqwen", {}).get("weights", {})
    theirs = report["engines"].get("llama.cpp", {}).get("weights", {})
    return {**{k: v for k, v in ours.items() if not k.endswith("_s") and not k.startswith(("weights_bytes",
                                                                                           "weights_rss",
                                                                                           "weights_8b"))},
            **{k: v for k, v in theirs.items() if k.endswith("_vs_llama_cpp")}}


def rows(report) -> list:
    return []


def tables(report) -> list:
    ours = report["engines"].get("npqwen", {}).get("weights", {})
    return (float32_table(ours) if ours else []) + llama_cpp_table(report)


def float32_table(ours) -> list:
    formats = ["float32"] + [k[len("weights_bytes_"):] for k in ours if k.startswith("weights_bytes_")][1:]

    def cell(key, fmt="{:.2f}"):
        return fmt.format(ours[key]) if key in ours else "-"

    body = [("weights in memory (MiB)", [f"{ours[f'weights_bytes_{f}'] / 2**20:,.0f}" for f in formats])]
    for kind, label in (("decode", "batch-1 decode, x float32"), ("prefill", "prefill, x float32"),
                        ("batched", "batched decode step, x float32")):
        body.append((label, ["1.00"] + [cell(f"weights_{kind}_{f}_vs_float32") for f in formats[1:]]))
    for kind, label in (("load", "peak RSS after load (GB)"), ("generate", "peak RSS, 1,024 positions (GB)")):
        if any(f"weights_rss_{kind}_{f}" in ours for f in formats):
            body.append((label, [f"{ours[f'weights_rss_{kind}_{f}'] / 1e9:.2f}" if f"weights_rss_{kind}_{f}"
                                 in ours else "-" for f in formats]))
    return [(formats, body)]


def llama_cpp_table(report) -> list:
    theirs = report["engines"].get("llama.cpp", {}).get("weights", {})
    ggml = [f for f in GGUF_FILES if f"weights_decode_{f}_vs_llama_cpp" in theirs]

    def against(kind, f):   # "0.25 (3.1 / 12.4)": the ratio, then npqwen's and llama.cpp's tokens/s
        ratio, ours, them = (theirs[f"weights_{kind}_{f}_vs_llama_cpp"], theirs[f"weights_npqwen_gguf_{kind}_{f}_tps"],
                             theirs[f"weights_llama_cpp_{kind}_{f}_tps"])
        return f"{ratio:.2f} ({ours:.1f} / {them:.1f})"

    body = [(f"{kind}, npqwen / llama.cpp tokens/s", [against(kind, f) for f in ggml]) for kind in ("decode", "prefill")]
    return [(["the same GGUF file"] + [GGUF_FILES[f] for f in ggml], body)] if ggml else []


def notes(report) -> list[str]:
    ours = report["engines"].get("npqwen", {}).get("weights", {})
    lines = [f"Qwen3-8B's shape, 36 layers, {fmt}: peak RSS {ours[f'weights_8b_rss_load_{fmt}'] / 1e9:.2f} GB after "
             f"loading, {ours[f'weights_8b_rss_generate_{fmt}'] / 1e9:.2f} GB after its context"
             for fmt in ("q4_k", "q8_0") if f"weights_8b_rss_load_{fmt}" in ours]
    skipped = report["engines"].get("llama.cpp", {}).get("weights", {}).get("llama_cpp_skipped")
    return lines + ([f"weights: the llama.cpp engine was skipped: {skipped}"] if skipped else [])
