"""docs/embeddings.md: every ```python sample, in order, as one script."""
import subprocess
import sys

from conftest import ROOT, doc_samples


def test_embeddings_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("embeddings.md")
    assert len(python) >= 7 and not shell
    script = tmp_path / "embeddings_doc.py"
    script.write_text("\n\n".join(python))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    print(result.stdout[-3000:])
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
