"""Shared by the GGUF tests: llama.cpp from node-llama-cpp (tools/fetch_node_llama_cpp.sh), or a skip saying why."""
import ctypes
import os
import platform
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODE_LLAMA_CPP = Path(os.environ.get("NPQWEN_NODE_LLAMA_CPP", ROOT / ".cache" / "node-llama-cpp"))
LLAMA_CPP_BINS = NODE_LLAMA_CPP / "node_modules" / "@node-llama-cpp" / "linux-x64" / "bins" / "linux-x64"
LLAMA_CPP_SOURCE = NODE_LLAMA_CPP / "llama.cpp"


def needs_llama_cpp():
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("node-llama-cpp's prebuilt llama.cpp used here is the linux-x64 one")
    if not LLAMA_CPP_BINS.is_dir() or not (LLAMA_CPP_SOURCE / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp (node-llama-cpp 3.21.1) is not in {NODE_LLAMA_CPP}: run "
                    f"tools/fetch_node_llama_cpp.sh (needs npm) or set NPQWEN_NODE_LLAMA_CPP")


def llama_cpp_lib(name: str) -> ctypes.CDLL:
    """One of llama.cpp's prebuilt shared libraries (libggml-base.so, libllama.v0.4.0.so)."""
    needs_llama_cpp()
    return ctypes.CDLL(str(LLAMA_CPP_BINS / name))
