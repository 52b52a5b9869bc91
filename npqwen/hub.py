"""Find a model: a local directory, or a hub id (Qwen/Qwen3-0.6B) in the Hugging Face cache,
downloaded with huggingface_hub when it is installed and the network answers."""
import difflib
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


def snapshots_of(repo_id: str) -> list[Path]:
    """The snapshot directories of `repo_id` in the HF cache, refs/main's first, then the newest."""
    repo = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return []
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    ref = repo / "refs" / "main"
    main = snapshots / ref.read_text().strip() if ref.is_file() else None
    return sorted(found, key=lambda p: p != main)   # stable: refs/main first, the rest newest first


def missing_files(directory: Path, tokenizer: bool = False) -> list[str]:
    """What a checkpoint directory lacks to be loaded: config.json, the weights (and, with `tokenizer`,
    the tokenizer.json that text needs)."""
    missing = [] if (directory / "config.json").is_file() else ["config.json"]
    if not any(directory.glob("*.safetensors")):
        missing.append("*.safetensors")
    if tokenizer and not (directory / "tokenizer.json").is_file():
        missing.append("tokenizer.json")
    return missing


def find_cached(repo_id: str) -> Path | None:
    """The snapshot directory of `repo_id` in the HF cache (refs/main first) that holds config.json and weights."""
    return next((p for p in snapshots_of(repo_id) if not missing_files(p)), None)


def resolve_model(name: str | os.PathLike) -> Path:
    """A checkpoint directory for `name`: a local path, or a cached (or downloadable) hub id; or a GGUF file
    (a path, or "ollama:qwen3:8b" for the blob of a model Ollama has pulled)."""
    from .gguf_file import is_gguf, ollama_blob

    if not isinstance(name, (str, os.PathLike)):
        raise NpqwenError(f"a model is a checkpoint directory (a str or a path), a hub id such as {DEFAULT_MODEL}, "
                          f"a GGUF file, or a built-in name such as 'tiny'; got {type(name).__name__} {str(name)[:40]!r}")
    if str(name).startswith("ollama:"):
        return ollama_blob(str(name).removeprefix("ollama:"))
    path = Path(name).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    if path.exists():
        raise NpqwenError(f"{str(name)!r} is a file, not a checkpoint directory nor a GGUF file: give the directory "
                          f"that holds config.json and the *.safetensors weights, a GGUF file, or a hub id such as {DEFAULT_MODEL}")
    if not HUB_ID.match(str(name)):
        from .tiny import BUILTIN   # a built-in name mistyped: --model tinyy

        near = difflib.get_close_matches(str(name), BUILTIN, n=1)
        hint = f"; did you mean {near[0]!r}, the built-in model?" if near else ""
        raise NpqwenError(f"no such directory: {str(name)!r} (a model is a checkpoint directory, or a hub id such "
                          f"as {DEFAULT_MODEL}){hint}")
    cached = find_cached(str(name))
    if cached is not None:
        return cached
    # "models/Qwen3-0.6B" looks like a hub id too; when its first part is a local folder, it is a mistyped path.
    if path.parent.is_dir():
        raise NpqwenError(f"no such directory: {str(name)!r} ({path.parent}/ exists but holds no {path.name!r}); "
                          f"check the path")
    partial = snapshots_of(str(name))
    if partial:
        what = f"{name} is only partly in the Hugging Face cache ({partial[0]} has no " \
               f"{' and no '.join(missing_files(partial[0]))})"
        how = f"complete it with `hf download {name}`"
    else:
        what = f"{name} is not a local directory and not in the Hugging Face cache ({hf_cache_dir()})"
        how = (f"download it with `hf download {name}`, or pass --model a local checkpoint directory; "
               f"--model tiny runs a small built-in model (random weights) with no download")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:   # tokenizers depends on it, so only a broken install lacks it
        raise NpqwenError(f"{what}, and huggingface_hub is not installed (pip install huggingface_hub): {how}"
                          ) from None
    try:
        path = Path(snapshot_download(str(name), allow_patterns=FILES))
    except Exception as e:   # offline, unknown repo, gated repo: huggingface_hub has many error types
        raise NpqwenError(f"{what}, and downloading it failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}): {how}") from None
    if missing_files(path):
        raise NpqwenError(f"{name}: the download has no {' and no '.join(missing_files(path))}; is it a Qwen3 "
                          f"checkpoint with safetensors weights?")
    return path
