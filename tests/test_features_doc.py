"""docs/features.md: the ```python samples as one script, then the ```bash lines, with the built-in tiny model in
place of Qwen/Qwen3-0.6B. The bare ``` block is the formulas, shown and not run (test_features.py checks them); the ```json block a request
body, checked against the server's protocol."""
import json

from conftest import ROOT, doc_blocks, doc_samples, run_doc_line, run_doc_python


def test_features_doc_samples_run(tmp_path):
    python, shell = doc_samples("features.md", shown=("", "json"), swap={"Qwen/Qwen3-0.6B": "tiny", "/tmp/npqwen-sae-demo":
                                                     str(tmp_path / "sae"), "/tmp/npqwen-graphs": str(tmp_path / "g")})
    assert len(python) == 3 and len(shell) == 2
    result = run_doc_python(python, tmp_path / "features_doc.py")
    assert "relative error per token" in result.stdout and "eiffel.json" in result.stdout
    assert json.loads((tmp_path / "g" / "eiffel.json").read_text())["metadata"]["slug"] == "eiffel"
    out = run_doc_line(shell[0]).stdout
    print(out)
    assert "sae topk k=16" in out and "top features" in out
    assert run_doc_line(shell[1]).stdout.strip()   # generate with --clamp-feature: some text


def test_the_request_body_shown_is_one_the_server_takes():
    """The ```json block is a completions body with feature_edits, as the server's protocol reads it."""
    from npqwen.server.protocol import CompletionRequest

    (body,) = [json.loads(code) for lang, code in doc_blocks(ROOT / "docs" / "features.md") if lang == "json"]
    assert CompletionRequest.model_validate(body).feature_edits[0].clamp == 50.0
