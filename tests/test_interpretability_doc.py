"""docs/interpretability.md: every ```python sample as one script (it saves the steering vector), then every
```bash line, with the built-in tiny model in place of Qwen/Qwen3-0.6B. The ```text block is a curl call to a
running server (the server's steering field is tested in test_server_steering.py)."""
import pytest

from conftest import doc_samples, run_doc_line, run_doc_python

pytest.importorskip("matplotlib")   # the patching heatmap, npqwen lens --plot


def test_interpretability_doc_samples_run(tmp_path):
    python, shell = doc_samples("interpretability.md", shown=("", "text"), swap={"Qwen/Qwen3-0.6B": "tiny"})
    assert len(python) >= 7 and len(shell) >= 3
    result = run_doc_python(python, tmp_path / "interpretability_doc.py")
    assert "restores 1.0" in result.stdout
    for line in shell:
        print(run_doc_line(line).stdout)
