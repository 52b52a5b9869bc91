"""docs/interpretability.md: every ```python sample as one script (it saves the steering vector), then every
```bash line, with the built-in tiny model in place of Qwen/Qwen3-0.6B. The ```text block is a curl call to a
running server (the server's steering field is tested in test_server_steering.py)."""
import re

import pytest

from conftest import ROOT, doc_samples, run_doc_line, run_doc_python

pytest.importorskip("matplotlib")   # the patching heatmap, npqwen lens --plot


def test_interpretability_doc_samples_run(tmp_path):
    python, shell = doc_samples("interpretability.md", shown=("", "text"),
                                swap={"Qwen/Qwen3-0.6B": "tiny", "--steer-layer 14": "--steer-layer 1"})   # L // 2
    assert len(python) >= 7 and len(shell) >= 3
    result = run_doc_python(python, tmp_path / "interpretability_doc.py")
    assert "restores 1.0" in result.stdout
    for line in shell:
        print(run_doc_line(line).stdout)


def test_patching_sample_stays_small_at_the_0_6b_shape():
    """The patching sample runs one forward pass per (layer, position): at Qwen3-0.6B's 28 layers and
    14 tokens its few layers are under 60 passes (all of them would be 392, about 20 minutes on two
    cores), and the page says what the full sweep costs."""
    text = (ROOT / "docs" / "interpretability.md").read_text(encoding="utf-8")
    layers = re.search(r"^layers = (.*?)  +#", text, re.M)
    assert layers, "the patching sample names the layers it patches"
    chosen = eval(layers.group(1), {"L": 28})
    assert 0 < len(chosen) * 14 < 60 and max(chosen) == 27, chosen
    assert "28 x 14 = 392 passes" in text


def test_steering_is_at_the_same_layer_in_python_the_command_line_and_the_server():
    """The vector is made at `layer = L // 2` in the Python sample; the command line and the server's
    body steer at that layer of Qwen3-0.6B (28 layers), not at another (a vector of one layer's stream
    added at another)."""
    text = (ROOT / "docs" / "interpretability.md").read_text(encoding="utf-8")
    layer = eval(re.search(r"^layer = (.*)$", text, re.M).group(1), {"L": 28})
    assert re.findall(r"--steer-layer (\d+)", text) == [str(layer)], layer
    assert re.findall(r'"layer": (\d+), "vector"', text) == [str(layer)], layer
