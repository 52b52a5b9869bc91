"""Find a model: a local directory, or a hub id (Qwen/Qwen3-0.6B) in the Hugging Face cache,
downloaded with huggingface_hub when it is installed and the network answers."""
import os
import re
from pathlib import Path

from .errors import NpqwenError

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "*.safetensors", "model.safetensors.index.json"]


def hf_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def find_cached(repo_id: str) -> Path | None:
    """The snapshot directory of `repo_id` in the HF cache (refs/main first), if it holds a config.json."""
    repo = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
        return snapshots / ref.read_text().strip()
    candidates = sorted((p for p in snapshots.glob("*") if (p / "config.json").is_file()),
                        key=lambda p: p.stat().st_mtime, reverse=True) if snapshots.is_dir() else []
    return candidates[0] if candidates else None


def resolve_model(name: str | os.PathLike) -> Path:
    """A checkpoint directory for `name`: a local path, or a cached (or downloadable) hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if not HUB_ID.match(str(name)):
        raise NpqwenError(f"model directory {str(name)!r} does not exist")
    cached = find_cached(str(name))
    if cached is not None:
        return cached
    how = (f"download it with `hf download {name}` (pip install huggingface_hub), or pass --model a local "
           f"checkpoint directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise NpqwenError(f"{name} is not in the Hugging Face cache ({hf_cache_dir()}) and huggingface_hub is "
                          f"not installed: {how}") from None
    try:
        return Path(snapshot_download(str(name), allow_patterns=FILES))
    except Exception as e:   # offline, unknown repo, gated repo: huggingface_hub has many error types
        raise NpqwenError(f"{name} is not in the Hugging Face cache ({hf_cache_dir()}) and downloading it "
                          f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                          f"{how}") from None
