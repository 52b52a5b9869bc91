"""`npqwen compare` on Qwen4-Exp: every step a trace records (each layer's PLE, the hyper-connections' mixed inputs,
the Gated DeltaNet's and QSA's steps with the indexer's selection, the MoE's, the C streams after attention and at the
layer's output, the final mixer, lm_head) against the HF module that holds the same array, in forward order; a
weight corrupted in one layer (a PLE gate's key, the indexer, a hyper-connection) is named at that layer's module."""
import numpy as np
import pytest

import npqwen
from npqwen.compare import compare, report
from npqwen.hooks import step_names

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.qwen4_exp")

# after the skips: it imports transformers' module
from test_qwen4_exp import CASES, build

IDS = np.random.default_rng(5).integers(0, 300, 40).tolist()   # 40 tokens: QSA's budget of 8 selects


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen4_compare"))[0]


def test_compare_maps_every_step_to_hf(checkpoint):
    llm = npqwen.load(checkpoint)
    rows = compare(llm, IDS)
    print(report(rows, 1e-3))
    names = step_names(llm.config)
    assert [r["name"] for r in rows] == names, f"not compared: {sorted(set(names) - {r['name'] for r in rows})}"
    assert all(r["ok"] for r in rows), report(rows, 1e-3)
    assert max(r["max_abs_diff"] for r in rows) <= 1e-4   # float32's rounding, far inside compare's 1e-3
    selection = next(r for r in rows if r["name"] == "model.layers.3.self_attn.indexer")
    assert selection["max_abs_diff"] == 0   # the same tokens selected, exactly


@pytest.mark.parametrize("corrupt, module", [
    ("model.layers.1.ple.key_proj.weight", "model.layers.1.ple"),                           # PLE's gate
    ("model.layers.3.self_attn.indexer.index_qk_proj.weight", "model.layers.3.self_attn.indexer"),   # QSA's choice
    ("model.layers.2.mlp_hyper_connection.input_mix_weight_up.weight", "model.layers.2.mlp_hyper_connection")])
def test_compare_names_the_module_of_a_corrupted_weight(checkpoint, corrupt, module):
    llm = npqwen.load(checkpoint)
    W = llm.weights[corrupt]
    W[-W.shape[0] // 4:] *= -1   # in place, in npqwen only (HF reads the checkpoint): the last quarter of the rows
    # (the last stream's, for the PLE key and the hyper-connection; the indexer's key and its last heads' queries)
    rows = compare(llm, IDS)
    first = next(r for r in rows if not r["ok"])
    print(f"{corrupt}: first past the tolerance {first['name']} (max |diff| {first['max_abs_diff']:.3e})")
    assert first["name"] == module, report(rows, 1e-3)


def test_the_compare_command_on_the_hub_layout(tmp_path, capsys):
    """`npqwen compare --model` on Qwen4ExpForConditionalGeneration's checkpoint (the text model inside, C = 4,
    GQA, partial mRoPE, saved in bfloat16): every step within the tolerance, exit status 0."""
    from npqwen.cli import main

    text, hub, dtype, _ = CASES["hub-layout-vision-C4-GQA-partial-rope-bf16"]
    path, _ = build(tmp_path, text, hub, dtype, seed=1)
    npqwen.load("tiny").tokenizer.save(path)   # a byte-level tokenizer: ASCII text gives ids < 300
    code = main(["compare", "--model", str(path), "--prompt", "Four streams, one lens; QSA picks the blocks."])
    out = capsys.readouterr().out
    print(out.splitlines()[-1])
    assert code == 0 and "all 95 steps within 0.001" in out, out   # 3 + 2 x (PLE, Gated DeltaNet: 21) + 2 x (QSA: 24) + 2
    for name in ("model.layers.2.ple", "model.layers.1.self_attn.indexer", "model.layers.3.attn_residual",
                 "model.hyper_connection_mixer"):
        assert f"\n{name} " in out, name
