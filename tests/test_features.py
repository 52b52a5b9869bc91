"""SAEs and transcoders (npqwen/features.py): each format written by its own tools' conventions (torch.save for
Qwen-Scope, safetensors + cfg.json for SAELens, safetensors + config.yaml for circuit-tracer), at Qwen3-0.6B's
width (D=1024, two layers), loaded without torch and run by llm.run_with_saes; compared with the published
encode/decode formulas computed with torch on HF transformers' own activations; a malicious pickle refused."""
import json
import os
import pickle
import zipfile

import numpy as np
import pytest

import npqwen
from npqwen import NpqwenError

from conftest import QWEN3_0_6B, build_hf_checkpoint, hf_model
from serving import tokens_to_end

torch = pytest.importorskip("torch")

F = 2048        # features (Qwen-Scope uses 16x D; fewer keep the test fast)
PROMPT = [5, 17, 33, 2, 101, 7, 64, 250, 9, 12, 40]
TOL = 1e-5      # max |diff| / max |reference|


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Qwen3-0.6B's widths (D=1024, F=3072, 16/8 heads of 128) with two layers and a small vocabulary."""
    cfg = {**QWEN3_0_6B, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512}
    return build_hf_checkpoint(tmp_path_factory.mktemp("sae06"), cfg, save_dtype="float32", std=0.05)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return npqwen.load(checkpoint)


@pytest.fixture(scope="module")
def hf_acts(checkpoint):
    """HF's block-0 output and its MLP's input and output for PROMPT, (T, D) each, as torch tensors."""
    model, seen = hf_model(checkpoint), {}
    layer = model.model.layers[0]
    h1 = layer.register_forward_hook(lambda m, a, out: seen.__setitem__("block", out[0] if isinstance(out, tuple)
                                                                         else out))
    h2 = layer.mlp.register_forward_hook(lambda m, a, out: seen.update(mlp_in=a[0], mlp_out=out))
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    h1.remove(), h2.remove()
    return {k: v[0].float() for k, v in seen.items()}


def random_weights(D=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(D, F, generator=g) / D ** 0.5, "W_dec": torch.randn(F, D, generator=g) / F ** 0.5,
            "b_enc": 0.1 * torch.randn(F, generator=g), "b_dec": 0.1 * torch.randn(D, generator=g),
            "threshold": 0.5 * torch.rand(F, generator=g)}


def torch_topk(pre, k):   # SAELens / Qwen-Scope TopK: keep the k largest pre-activations, relu'd
    vals, idx = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, idx, torch.relu(vals))


def torch_jumprelu(pre, threshold):   # SAELens / circuit-tracer JumpReLU: pre where pre > threshold
    return pre * (pre > threshold)


def close(name, got, want):
    want = want.detach().numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{name}: max|diff|/max|ref| = {err:.2e}")
    assert err <= TOL, f"{name} differs: {err:.2e} relative"


def check_run(run, acts, recon, target):
    close("activations", run.acts, acts)
    close("reconstruction", run.reconstruction, recon)
    close("error", run.error, target - recon)
    top = np.sort(run.values, axis=-1)[:, ::-1]
    assert (np.diff(run.values, axis=-1) <= 0).all() and np.array_equal(top, run.values)   # strongest first
    assert np.allclose(np.take_along_axis(run.acts, run.indices, -1), run.values)


def test_qwen_scope_sae_pt(llm, hf_acts, tmp_path):
    w = random_weights()
    folder = tmp_path / "SAE-Res-Qwen3-0.6B-W2K-L0_50"
    folder.mkdir()
    # Qwen-Scope's layout: W_enc (F, D), W_dec (D, F); W_dec saved as a transposed (non-contiguous) view
    torch.save({"W_enc": w["W_enc"].T.contiguous(), "W_dec": w["W_dec"].T, "b_enc": w["b_enc"], "b_dec": w["b_dec"]},
               folder / "layer0.sae.pt")
    sae = npqwen.load_sae(folder / "layer0.sae.pt", llm.config)
    assert (sae.architecture, sae.k, sae.reads, sae.kind) == ("topk", 50, "model.layers.0", "sae")
    _, (run,) = llm.run_with_saes(PROMPT, [sae], top=5)
    x = hf_acts["block"]
    acts = torch_topk(x @ w["W_enc"] + w["b_enc"], 50)
    check_run(run, acts, acts @ w["W_dec"] + w["b_dec"], x)
    assert run.indices.shape == (len(PROMPT), 5) and ((run.acts > 0).sum(-1) <= 50).all()


def test_qwen_scope_bf16_storage_is_widened(tmp_path):
    w = {"W_enc": torch.randn(16, 8), "W_dec": torch.randn(8, 16), "b_enc": torch.randn(16), "b_dec": torch.randn(8)}
    torch.save({k: v.bfloat16() for k, v in w.items()}, tmp_path / "layer0.sae.pt")
    sae = npqwen.features.load_qwen_scope(tmp_path / "layer0.sae.pt", k=4)
    assert np.array_equal(sae.W_enc, w["W_enc"].bfloat16().float().T.numpy())
    assert np.array_equal(sae.W_dec, w["W_dec"].bfloat16().float().T.numpy())


class RunsCode:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_malicious_pickle_is_refused(tmp_path):
    bad = RunsCode()
    bad.marker = tmp_path / "pwned"
    torch.save({"W_enc": torch.zeros(2, 2), "payload": bad}, tmp_path / "layer0.sae.pt")
    with pytest.raises(NpqwenError, match=r"refused to load: the file asks to run (posix|os)\.system"):
        npqwen.features.load_qwen_scope(tmp_path / "layer0.sae.pt", k=1)
    assert not bad.marker.exists()
    # a hand-made one: builtins.eval inside an otherwise valid torch zip
    with zipfile.ZipFile(tmp_path / "layer1.sae.pt", "w") as z:
        z.writestr("layer1/data.pkl", b"cbuiltins\neval\n(S'1+1'\ntR.")
    with pytest.raises(NpqwenError, match=r"builtins\.eval"):
        npqwen.features.load_qwen_scope(tmp_path / "layer1.sae.pt", k=1)
    (tmp_path / "layer2.sae.pt").write_bytes(pickle.dumps({"W_enc": 1}))   # a legacy (non-zip) pickle
    with pytest.raises(NpqwenError, match="not a torch zip file"):
        npqwen.features.load_qwen_scope(tmp_path / "layer2.sae.pt", k=1)


def write_saelens(folder, w, cfg):
    from safetensors.torch import save_file
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in w.items()}, folder / "sae_weights.safetensors")
    (folder / "cfg.json").write_text(json.dumps({"d_in": 1024, "d_sae": F, "model_name": "Qwen/Qwen3-0.6B", **cfg}))
    return folder


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk"])
def test_saelens_layout(llm, hf_acts, tmp_path, architecture):
    w = random_weights(seed=1)
    if architecture != "jumprelu":
        del w["threshold"]
    cfg = {"architecture": architecture, "hook_name": "blocks.0.hook_resid_post",
           "apply_b_dec_to_input": architecture == "standard", **({"k": 32} if architecture == "topk" else {})}
    sae = npqwen.load_sae(write_saelens(tmp_path / "sae", w, cfg), llm.config)
    _, (run,) = llm.run_with_saes(PROMPT, sae)
    x = hf_acts["block"]
    if architecture == "standard":   # SAELens standard: relu((x - b_dec) W_enc + b_enc)
        acts = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    elif architecture == "jumprelu":
        acts = torch_jumprelu(x @ w["W_enc"] + w["b_enc"], w["threshold"])
    else:
        acts = torch_topk(x @ w["W_enc"] + w["b_enc"], 32)
    check_run(run, acts, acts @ w["W_dec"] + w["b_dec"], x)


@pytest.mark.parametrize("activation", ["jumprelu", "relu"])
def test_circuit_tracer_transcoder(llm, hf_acts, tmp_path, activation):
    from safetensors.torch import save_file
    w = random_weights(seed=2)
    # circuit-tracer's file: W_enc (F, D), W_dec (F, D), activation_function.threshold for JumpReLU
    tensors = {"W_enc": w["W_enc"].T.contiguous(), "W_dec": w["W_dec"], "b_enc": w["b_enc"], "b_dec": w["b_dec"]}
    if activation == "jumprelu":
        tensors["activation_function.threshold"] = w["threshold"]
    save_file(tensors, tmp_path / "layer_0.safetensors")
    (tmp_path / "config.yaml").write_text("model_name: Qwen/Qwen3-0.6B\nfeature_input_hook: mlp.hook_in\n"
                                          "feature_output_hook: mlp.hook_out\ntranscoders:\n  - layer_0.safetensors\n")
    tc = npqwen.load_sae(tmp_path / "layer_0.safetensors", llm.config)
    assert (tc.kind, tc.reads, tc.writes, tc.architecture) == (
        "transcoder", "model.layers.0.post_attention_layernorm", "model.layers.0.mlp.down_proj", activation)
    _, (run,) = llm.run_with_saes(PROMPT, [tc])
    pre = torch.nn.functional.linear(hf_acts["mlp_in"], w["W_enc"].T, w["b_enc"])   # circuit-tracer's encode
    acts = torch_jumprelu(pre, w["threshold"]) if activation == "jumprelu" else torch.relu(pre)
    check_run(run, acts, acts @ w["W_dec"] + w["b_dec"], hf_acts["mlp_out"])


def test_mismatches_are_named(llm, tmp_path):
    w = random_weights(D=64)
    del w["threshold"]
    cfg = {"architecture": "standard", "hook_name": "blocks.0.hook_resid_post", "d_in": 64}
    folder = write_saelens(tmp_path / "narrow", w, cfg)
    with pytest.raises(NpqwenError, match=r"reads vectors of 64 values but this model's hidden size is 1024 "
                                          r"\(its file names Qwen/Qwen3-0.6B\)"):
        npqwen.load_sae(folder, llm.config)
    w = random_weights()
    del w["threshold"]
    folder = write_saelens(tmp_path / "deep", w, {"architecture": "standard", "hook_name": "blocks.7.hook_resid_post"})
    with pytest.raises(NpqwenError, match=r"unknown SAE hook name 'model.layers.7'"):
        npqwen.load_sae(folder, llm.config)
    w["b_dec"] = w["b_dec"][:10]
    folder = write_saelens(tmp_path / "bad", w, {"architecture": "standard", "hook_name": "blocks.0.hook_resid_post"})
    with pytest.raises(NpqwenError, match=r"b_dec has shape \(10,\), but W_enc \(1024, 2048\) needs \(1024,\)"):
        npqwen.load_sae(folder)
    folder = write_saelens(tmp_path / "topk", random_weights(), {"architecture": "topk",
                                                                 "hook_name": "blocks.0.hook_resid_post"})
    with pytest.raises(NpqwenError, match="a TopK SAE needs k"):
        npqwen.load_sae(folder)
    with pytest.raises(NpqwenError, match="no such file or folder"):
        npqwen.load_sae(tmp_path / "nowhere")


# ---- feature edits through the engine, against a torch hook on HF with the same SAE -------------------------

N = 10
OTHER = [8, 19, 300, 77, 6]


@pytest.fixture(scope="module")
def topk_sae(llm, tmp_path_factory):
    w = random_weights(seed=3)
    del w["threshold"]
    folder = write_saelens(tmp_path_factory.mktemp("edit") / "sae", w,
                           {"architecture": "topk", "k": 32, "hook_name": "blocks.0.hook_resid_post"})
    return npqwen.load_sae(folder, llm.config), w


def edit_hook(w, feature, mode, value):
    """A torch forward hook on a block that sets the feature as npqwen does: x + (a' - a) W_dec[f]."""
    def hook(module, args, out):
        x = out[0] if isinstance(out, tuple) else out
        a = torch_topk(x @ w["W_enc"] + w["b_enc"], 32)[..., feature]
        new = torch.full_like(a, value) if mode == "clamp" else a * (0.0 if mode == "zero" else value)
        x = x + (new - a)[..., None] * w["W_dec"][feature]
        return (x, *out[1:]) if isinstance(out, tuple) else x
    return hook


def hf_edited(checkpoint, w, feature, mode, value):
    """HF generate with edit_hook on block 0."""
    model = hf_model(checkpoint)
    handle = model.model.layers[0].register_forward_hook(edit_hook(w, feature, mode, value))
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    finally:
        handle.remove()
    return out[0, len(PROMPT):].tolist()


def run_engine(engine, requests):
    return tokens_to_end(engine, [engine.add_request(p, max_new_tokens=N, temperature=0, feature_edits=e)
                                  for p, e in requests])


@pytest.mark.parametrize("mode, value", [("clamp", 40.0), ("zero", 0.0), ("scale", 300.0)])
def test_feature_edit_beside_an_unedited_request(llm, checkpoint, topk_sae, mode, value):
    sae, w = topk_sae
    _, (run,) = llm.run_with_saes(PROMPT, sae, top=1)
    feature = int(run.indices[-1, 0])   # the last prompt token's strongest
    edit = [{"sae": sae, "feature": feature, mode: True if mode == "zero" else value}]
    engine = npqwen.Engine(llm, kv_cache_tokens=256, page_size=8)
    edited, plain = run_engine(engine, [(PROMPT, edit), (OTHER, None)])
    (alone,) = run_engine(npqwen.Engine(llm, kv_cache_tokens=256, page_size=8), [(OTHER, None)])
    (unedited,) = run_engine(npqwen.Engine(llm, kv_cache_tokens=256, page_size=8), [(PROMPT, None)])
    want = hf_edited(checkpoint, w, feature, mode, value)
    print(f"{mode} feature {feature}\nedited   {edited}\nHF hook  {want}\nunedited {unedited}\nbeside   {plain}\n"
          f"alone    {alone}")
    assert plain == alone
    assert edited == want and len(edited) == N
    if mode != "zero":
        assert edited != unedited
    assert llm.generate(PROMPT, max_new_tokens=N, temperature=0, feature_edits=edit).token_ids == edited


def test_the_prefix_cache_is_keyed_by_the_edits(llm, topk_sae):
    sae, _ = topk_sae
    edit = [{"sae": sae, "feature": 3, "clamp": 40.0}]
    engine = npqwen.Engine(llm, kv_cache_tokens=256, page_size=4)
    (plain,) = run_engine(engine, [(PROMPT, None)])
    (edited,) = run_engine(engine, [(PROMPT, edit)])
    (fresh,) = run_engine(npqwen.Engine(llm, kv_cache_tokens=256, page_size=4), [(PROMPT, edit)])
    assert edited == fresh != plain


@pytest.mark.parametrize("edit, says", [
    ({"feature": 1, "clamp": 1.0}, r"feature_edits\[0\].sae must be an SAE"),
    ({"feature": F, "clamp": 1.0}, rf"feature_edits\[0\].feature must be a feature from 0 to {F - 1}"),
    ({"feature": 1}, "exactly one of clamp"),
    ({"feature": 1, "clamp": float("nan")}, r"feature_edits\[0\].clamp must be a finite number"),
    ({"feature": 1, "clmap": 2.0}, "unknown field 'clmap'"),
])
def test_bad_edits_are_named(llm, topk_sae, edit, says):
    edit = {"sae": topk_sae[0], **edit} if "sae must" not in says else edit
    with pytest.raises(NpqwenError, match=says):
        llm.generate(PROMPT, max_new_tokens=2, feature_edits=[edit])


def test_the_features_command(tmp_path, capsys):
    from npqwen.checkpoint import save_safetensors
    from npqwen.cli import main

    rng, D = np.random.default_rng(0), 16   # the built-in tiny model's hidden size
    (tmp_path / "sae").mkdir()
    save_safetensors(tmp_path / "sae" / "sae_weights.safetensors", {
        "W_enc": rng.standard_normal((D, 64)).astype(np.float32), "W_dec": rng.standard_normal((64, D)).astype(
            np.float32), "b_enc": np.zeros(64, np.float32), "b_dec": np.zeros(D, np.float32)})
    (tmp_path / "sae" / "cfg.json").write_text(json.dumps({"architecture": "topk", "k": 4,
                                                           "hook_name": "blocks.1.hook_resid_post"}))
    assert main(["features", "-m", "tiny", "-p", "ab", "--sae", str(tmp_path / "sae"), "--top-k", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    print("\n".join(out))
    sae = npqwen.load_sae(tmp_path / "sae")
    _, (run,) = npqwen.load("tiny").run_with_saes("ab", sae, top=2)
    assert out[0].endswith("sae topk k=4, 64 features, reads model.layers.1") and len(out) == 2 + 2
    assert out[2].split()[3:] == [f"{i}:{v:.3g}" for i, v in zip(run.indices[0], run.values[0])]
    assert main(["features", "-m", "tiny", "-p", "ab", "--sae", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("npqwen: error: ") and "no such file or folder" in err and "Traceback" not in err


@pytest.mark.parametrize("mode, value", [("clamp", 40.0), ("zero", 0.0), ("scale", 3.0)])
def test_feature_edit_logits_equal_hf_with_a_hook(llm, checkpoint, topk_sae, mode, value):
    """Every prompt row's logits under the edit (forward_batch with Batch.feature_edits) against HF's with a torch
    hook doing the same: the zero edit, which leaves greedy tokens as they were above, moves the logits here."""
    from npqwen.features import check_feature_edits
    from npqwen.kv_cache import Batch

    sae, w = topk_sae
    _, (run,) = llm.run_with_saes(PROMPT, sae, top=1)
    feature = int(run.indices[-1, 0])
    (edit,) = check_feature_edits([{"sae": sae, "feature": feature, mode: True if mode == "zero" else value}],
                                  llm.config)
    T, cache = len(PROMPT), llm.model.new_cache(len(PROMPT))
    batch = Batch(np.array(PROMPT), [0], [T], [cache.page_table], cache.kv.page_size, sample_rows=np.arange(T),
                  feature_edits={0: [(edit, 0, T)]})
    got = llm.model.forward_batch(batch, cache.kv).logits

    model = hf_model(checkpoint)

    handle = model.model.layers[0].register_forward_hook(edit_hook(w, feature, mode, value))
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
    handle.remove()
    plain = llm.forward(PROMPT)
    moved = np.abs(got - plain).max()
    print(f"{mode}: max|npqwen - HF| {np.abs(got - want.numpy()).max():.2e}, the edit moved logits by {moved:.3f}")
    assert np.abs(got - want.numpy()).max() < 1e-4 and moved > 1e-2
