"""docs/gradients.md: every ```python sample, in order, as one script, then every ```bash line, with the built-in
tiny model in place of Qwen/Qwen3-0.6B (its finite-difference checks, attribution and fine-tuning samples run
there); the command's data file and adapter directory in tmp_path."""
import json

from conftest import doc_samples, run_doc_line, run_doc_python


def test_gradients_doc_samples_run(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    python, shell = doc_samples("gradients.md", swap={"Qwen/Qwen3-0.6B": "tiny", "data.jsonl": data,
                                                      "my-adapter": tmp_path / "adapter"})
    assert len(python) >= 5 and len(shell) == 2
    result = run_doc_python(python, tmp_path / "gradients_doc.py")
    assert "correlation" in result.stdout and "gap" in result.stdout
    for line in shell:
        print(run_doc_line(line).stdout)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
