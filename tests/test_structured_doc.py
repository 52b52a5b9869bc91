"""docs/structured-output.md: every ```python sample, in order, as one script, then every ```bash line,
with the built-in tiny model in place of Qwen/Qwen3-0.6B. Its weights are random, so only the mask
keeps its answers valid: the JSON answer is parsed (by the samples) and the choice is checked here."""
import pytest

from conftest import doc_samples, run_doc_line, run_doc_python

pytest.importorskip("llguidance")


def test_structured_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("structured-output.md", swap={"Qwen/Qwen3-0.6B": "tiny"})
    assert len(python) >= 1 and len(shell) >= 3
    run_doc_python(python, tmp_path / "structured_doc.py")
    for line in shell:
        result = run_doc_line(line)
        if "--choice yes --choice no" in line:
            assert result.stdout.strip() in ("yes", "no"), result.stdout
