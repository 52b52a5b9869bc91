"""docs/gguf.md: every ```python sample, in order, as one script; every ```bash line too. The page's file names
stand for a tiny GGUF written by the gguf package's GGUFWriter (tests/gguf_helpers.py), and `ollama:qwen3:0.6b`
for a fake Ollama folder holding it (OLLAMA_MODELS)."""
import pytest

from conftest import doc_samples, run_doc_line, run_doc_python

pytest.importorskip("gguf", reason="the gguf package (pip install gguf) reads GGUF files")

from gguf_helpers import write_gguf  # noqa: E402
from test_gguf import fake_ollama  # noqa: E402


def test_gguf_doc_code_samples_run(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny-Q4_K.gguf", "Q4_K")
    monkeypatch.setenv("OLLAMA_MODELS", str(fake_ollama(tmp_path / "ollama", path, "qwen3", "0.6b")))
    python, shell = doc_samples("gguf.md", swap={"Qwen3-0.6B-Q4_K_M.gguf": path})
    assert len(python) == 3 and len(shell) == 2
    result = run_doc_python(python, tmp_path / "gguf_doc.py")
    assert "Q4_K (256, 256)" in result.stdout and "blobs/sha256-" in result.stdout
    assert result.stdout.splitlines()[-1] == "True"   # section 3: llama.cpp's tiled value heads back in HF's order
    for line in shell:
        run_doc_line(line)
