"""docs/qwen-families.md: every ```python sample, in order, as one script."""
from conftest import doc_samples, run_doc_python


def test_qwen_families_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("qwen-families.md")
    assert len(python) == 3 and not shell
    result = run_doc_python(python, tmp_path / "qwen_families_doc.py")
    assert "Qwen3 q has unit RMS per head: True\nQwen2 q does not: True" in result.stdout
    assert "text-only mRoPE equals plain RoPE: True" in result.stdout
    assert "(3, 8) (3, 32) True" in result.stdout
