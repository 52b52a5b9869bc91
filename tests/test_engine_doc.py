"""docs/engine.md: every ```python sample, in order, as one script; every ```bash line too."""
import re

from conftest import doc_samples, run_doc_line, run_doc_python


def test_engine_doc_code_samples_run(tmp_path):
    python, shell = doc_samples("engine.md")
    assert len(python) >= 8 and len(shell) >= 2
    run_doc_python(python, tmp_path / "engine_doc.py")
    for line in shell:
        run_doc_line(line)


def test_engine_doc_samples_use_no_private_name_and_replace_no_part():
    """The samples show the engine through what it offers: no _private attribute read, no part of an
    engine replaced (`engine.model = ...`); what they do reach inside for, the text names."""
    code = "\n".join(doc_samples("engine.md")[0])
    private = re.findall(r"\w+\._\w+", code)
    replaced = re.findall(r"^\s*\w+(?:\.\w+)+\s*=(?!=).*", code, re.M)
    assert not private and not replaced, (private, replaced)
