"""llama.cpp from node-llama-cpp 3.21.1 (tools/fetch_node_llama_cpp.sh puts it in .cache/node-llama-cpp): its
converter (convert_hf_to_gguf.py, with its own gguf-py), its quantizer (llama_model_quantize in its prebuilt
libllama, what `llama-quantize` runs) and, through node, its next-token probabilities and speed. The GGUF
tests and tools/gguf_measure.py use these."""
import ctypes
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE_LLAMA_CPP = Path(os.environ.get("NPQWEN_NODE_LLAMA_CPP", ROOT / ".cache" / "node-llama-cpp"))
BINS = NODE_LLAMA_CPP / "node_modules" / "@node-llama-cpp" / "linux-x64" / "bins" / "linux-x64"
SOURCE = NODE_LLAMA_CPP / "llama.cpp"
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32,
          "F16": 1}   # llama_ftype


class QuantizeParams(ctypes.Structure):
    """llama.h's llama_model_quantize_params (llama.cpp v0.4.0, as node-llama-cpp 3.21.1 ships it)."""
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int32), ("output_tensor_type", ctypes.c_int32),
                ("token_embedding_type", ctypes.c_int32), ("allow_requantize", ctypes.c_bool),
                ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
                ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t)]


def library(name: str) -> ctypes.CDLL:
    """One of llama.cpp's prebuilt shared libraries (libggml-base.so, libllama.v0.4.0.so)."""
    return ctypes.CDLL(str(BINS / name))


def quantize(src: Path, dst: Path, ftype: str, threads: int = 1, pure: bool = False) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize) from an F32 GGUF to `ftype` (a key of FTYPES); `pure`
    (llama-quantize --pure) keeps every matrix in the ftype's one type, no mix (Q4_K_S pure: all Q4_K)."""
    lib = library("libllama.v0.4.0.so")
    lib.llama_model_quantize_default_params.restype = QuantizeParams
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.pure = FTYPES[ftype], threads, pure
    if lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {dst} ({ftype}) failed")
    return dst


def convert(checkpoint: Path, out: Path, outtype: str = "f32", *flags: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (with its own gguf-py) on an HF checkpoint directory; `flags` its own
    (--no-mtp: a Qwen3.5 without its multi-token-prediction layers)."""
    env = {**os.environ, "PYTHONPATH": str(SOURCE / "gguf-py")}
    result = subprocess.run([sys.executable, str(SOURCE / "convert_hf_to_gguf.py"), str(checkpoint),
                             "--outfile", str(out), "--outtype", outtype, *flags], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-3000:]}")
    return out
