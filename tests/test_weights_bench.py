"""The benchmark's weights suite measures memory in a process of its own on a checkpoint written directly in a compact
format (tools/bench/weights.py; the figures of docs/weights.md come from it at the 0.6B and 8B shapes): here a small
one, checked for what it holds and that the measurement fills the context it says."""
import numpy as np

import npqwen
from npqwen.config import QWEN3_0_6B_CONFIG
from npqwen.weights import total_bytes
from tools.bench.weights import memory, write_random

SMALL = dict(QWEN3_0_6B_CONFIG, hidden_size=256, intermediate_size=512, num_hidden_layers=2, max_window_layers=2,
             num_attention_heads=2, num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=False)


def test_memory_of_a_checkpoint_written_in_q4_k(tmp_path):
    path = write_random(tmp_path / "q4_k", SMALL, "q4_k")
    llm = npqwen.load(path)
    formats = {name: getattr(w, "format", "float32") for name, w in llm.weights.items()}
    assert formats["model.layers.1.mlp.down_proj.weight"] == "Q4_K" and formats["lm_head.weight"] == "Q4_K", formats
    assert formats["model.norm.weight"] == "float32", formats
    assert np.isfinite(llm.forward([1, 2, 3])).all()
    got = memory("q4_k", 300, path, decode=4, chunk=128)
    assert got["tokens"] == 4, got                         # 296 prompt tokens, then 4 generated: 300 positions
    assert got["generate"] >= got["load"] > 0, got
    assert got["generate"] > total_bytes(llm.model.weights), got   # the mapped weights count once they are read
