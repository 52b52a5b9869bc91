"""docs/linear-attention.md: every ```python sample, in order, as one script."""
from conftest import doc_samples, run_doc_python


def test_linear_attention_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("linear-attention.md")
    assert len(python) >= 4 and not shell
    result = run_doc_python(python, tmp_path / "linear_attention_doc.py")
    assert "read at k: [ 0.5 -1.   2. ]" in result.stdout
    assert "qwen3_next ['in_proj_qkvz', 'in_proj_ba', 'core_attn_out', 'norm', 'out_proj']" in result.stdout
    assert "('It is a matrix of dk x dv.', 'No.')\nFalse" in result.stdout
