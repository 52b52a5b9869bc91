"""docs/features.md: the ```python samples as one script, then the ```bash line, with the built-in tiny model in
place of Qwen/Qwen3-0.6B. The bare ``` block is the formulas, shown and not run (test_features.py checks them)."""
from conftest import doc_samples, run_doc_line, run_doc_python


def test_features_doc_samples_run(tmp_path):
    python, shell = doc_samples("features.md", swap={"Qwen/Qwen3-0.6B": "tiny", "/tmp/npqwen-sae-demo":
                                                     str(tmp_path / "sae")})
    assert len(python) == 2 and len(shell) == 1
    result = run_doc_python(python, tmp_path / "features_doc.py")
    assert "relative error per token" in result.stdout
    out = run_doc_line(shell[0]).stdout
    print(out)
    assert "sae topk k=16" in out and "top features" in out
