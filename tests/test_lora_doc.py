"""docs/lora.md: every ```python sample, in order, as one script; every ```bash line too."""
import pytest

from conftest import doc_samples, run_doc_line, run_doc_python


def test_lora_doc_code_samples_run(tmp_path):
    pytest.importorskip("peft")
    python, shell = doc_samples("lora.md")
    assert len(python) >= 6
    result = run_doc_python(python, tmp_path / "lora_doc.py")
    assert "['poet', None, 'poet']" in result.stdout and "max |npqwen - PEFT| = " in result.stdout
    outputs = [run_doc_line(line).stdout for line in shell]
    assert outputs[0] == outputs[2] and outputs[0].strip()   # the adapter kept apart, and merged
