"""npqwen: Qwen3 inference in plain NumPy (CPU) or CuPy (CUDA), numerically matching HF transformers."""
from .config import Qwen3Config
from .errors import NpqwenError
from .llm import LLM, load
from .engine import Engine
from .kv_cache import KVCache
from .model import Qwen3
from .sampling_params import SamplingParams
from .steering import steering_vector
from .features import load_sae

__version__ = "0.1.0"
__all__ = ["load", "LLM", "Qwen3", "Qwen3Config", "KVCache", "Engine", "SamplingParams", "steering_vector", "load_sae", "NpqwenError", "__version__"]
