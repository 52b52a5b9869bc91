"""docs/seeing-inside.md: every ```bash line, in order, then every ```python sample as one script (it
reads the file the trace command saved), with the built-in tiny model in place of Qwen/Qwen3-0.6B."""
import pytest

from conftest import doc_samples, run_doc_line, run_doc_python

pytest.importorskip("matplotlib")   # --plot-attention
pytest.importorskip("transformers")  # compare


def test_seeing_inside_doc_samples_run(tmp_path):
    python, shell = doc_samples("seeing-inside.md", swap={"Qwen/Qwen3-0.6B": "tiny"})
    assert len(python) >= 1 and len(shell) >= 6
    for line in shell:
        run_doc_line(line)
    run_doc_python(python, tmp_path / "seeing_inside_doc.py")
