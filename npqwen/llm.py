"""`npqwen.load`: a checkpoint directory -> an LLM (model + tokenizer)."""
from pathlib import Path

import numpy as np

from .backend import array_module
from .checkpoint import load_weights
from .config import Qwen3Config
from .errors import NpqwenError
from .model import Qwen3

DTYPES = {"cpu": ("float32", "float64"), "cuda": ("float32", "float16", "float64")}


class LLM:
    """A loaded Qwen3: `.config`, `.weights` (HF name -> array), `.tokenizer`, `.forward(ids)`."""

    def __init__(self, model: Qwen3, tokenizer=None, path: Path | None = None):
        self.model = model
        self.config = model.config
        self.weights = model.weights
        self.tokenizer = tokenizer
        self.path = path

    def forward(self, token_ids, cache=None, last_only=False, recorder=None):
        """Logits (T, V) in the compute dtype; see Qwen3.forward."""
        return self.model.forward(token_ids, cache=cache, last_only=last_only, recorder=recorder)

    def new_cache(self, capacity: int):
        return self.model.new_cache(capacity)


def load(path, device: str = "cpu", dtype: str = "float32") -> LLM:
    """Load a Hugging Face Qwen3 checkpoint directory onto `device` ("cpu" or "cuda") in `dtype`."""
    if device not in DTYPES:
        raise NpqwenError(f"unknown device {device!r}: use 'cpu' or 'cuda'")
    if dtype not in DTYPES[device]:
        hint = " (NumPy float16 matmuls are ~100x slower than float32)" if dtype == "float16" else ""
        raise NpqwenError(f"dtype {dtype!r} is not supported on {device}{hint}; use one of "
                          f"{', '.join(DTYPES[device])}")
    path = Path(path).expanduser()
    if not path.is_dir():
        raise NpqwenError(f"model directory {str(path)!r} does not exist")
    xp = array_module(device)
    config = Qwen3Config.from_json(path / "config.json")
    weights, fused = load_weights(path, config, xp, np.dtype(dtype))
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return LLM(Qwen3(config, weights, fused), tokenizer, path)
