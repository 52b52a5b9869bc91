"""The tools on hybrid checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): `npqwen compare` against HF module by
module, every traced step under HF's module names, score and `npqwen perplexity` equal to HF's log-probabilities,
and `npqwen inspect`'s linear layers and state sizes equal to what the engine allocates."""
import math
import re
import subprocess
import sys

import numpy as np
import pytest

import npqwen
from npqwen import Engine
from npqwen.compare import compare, hf_model, report
from npqwen.describe import describe
from npqwen.hooks import step_names
from npqwen.trace import Trace

from conftest import ROOT, add_qwen3_tokenizer, needs_qwen3_tokenizer
from hybrid_checkpoints import build_hybrid_checkpoint, hybrid_config, hybrid_moe_config, qwen3_next_config
from test_lens import assert_shares_add_up
from tolerance import logprob_tolerance

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

KINDS = {"qwen3_5": hybrid_config, "qwen3_5_moe": hybrid_moe_config, "qwen3_next": qwen3_next_config}
# steps HF has no module for: npqwen computes them between modules (compare derives them from HF's own functions)
COMPUTED = ("model.rotary_emb.cos", "model.rotary_emb.sin", ".q_rope", ".k_rope", ".attn_probs", ".attn_output",
            ".attn_residual", ".core_attn_out", ".gate.top_k_index", ".gate.top_k_weights")
TEXT = "A linear layer keeps a state matrix; the delta rule corrects it toward v at k. " * 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    needs_qwen3_tokenizer()
    made = {}

    def get(kind):
        if kind not in made:
            build = KINDS[kind.removesuffix("_hub")]   # _hub: the hub's image-text layout around the text model
            path = build_hybrid_checkpoint(tmp_path_factory.mktemp(kind), build(vocab_size=151936, eos_token_id=151645),
                                           std=0.1, hub_layout=kind.endswith("_hub"))
            made[kind] = add_qwen3_tokenizer(path)
        return made[kind]
    return get


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "npqwen", *args], capture_output=True, text=True, cwd=ROOT,
                          input=stdin, timeout=300)


@pytest.mark.parametrize("kind", [*KINDS, "qwen3_5_moe_hub"])
def test_compare_checks_every_step_against_hf(checkpoints, kind):
    llm = npqwen.load(checkpoints(kind))
    rows = compare(llm, llm.tokenizer.encode(TEXT), tol=1e-3)
    print(report(rows, 1e-3).splitlines()[-1])
    names = step_names(llm.config)
    assert [r["name"] for r in rows] == names, f"not compared: {sorted(set(names) - {r['name'] for r in rows})}"
    assert all(r["ok"] for r in rows), report(rows, 1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_is_named_as_hf_names_its_module(checkpoints, kind):
    """The names are the contract: every step a trace records is an HF module of the same name, or one of the
    few steps between modules; Qwen3-Next's linear layers have HF's two projections, Qwen3.5's its four."""
    path = checkpoints(kind)
    llm = npqwen.load(path)
    trace = Trace()
    llm.forward([1, 2, 3, 4], recorder=trace)
    assert list(trace) == step_names(llm.config)
    modules = {name for name, _ in hf_model(path).named_modules()}
    strays = [n for n in trace if n not in modules and not n.endswith(COMPUTED)]
    assert strays == [], f"steps not named after an HF module: {strays}"
    projections = [n.rsplit(".", 1)[1] for n in trace if n.startswith("model.layers.0.linear_attn.in_proj")]
    assert projections == (["in_proj_qkvz", "in_proj_ba"] if kind == "qwen3_next" else
                           ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])


def test_the_compare_command_on_a_hybrid_checkpoint(checkpoints):
    result = run_cli("compare", "--model", str(checkpoints("qwen3_next")), "--prompt", TEXT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    print(result.stdout.splitlines()[-1])
    for name in ("model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.linear_attn.core_attn_out",
                 "model.layers.3.self_attn.attn_probs", "model.layers.2.mlp.shared_expert_gate"):
        assert name in result.stdout, name
    assert re.search(r"all \d+ steps within 0.001", result.stdout)


def hf_log_probs(path, ids) -> np.ndarray:
    """Each token's log-probability given the ones before it, from HF's float32 logits."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return np.array([float(logp[j - 1, ids[j]]) for j in range(1, len(ids))])


@pytest.mark.parametrize("kind", KINDS)
def test_score_equals_hf_log_probs(checkpoints, kind):
    path = checkpoints(kind)
    llm = npqwen.load(path)
    ids = llm.tokenizer.encode(TEXT)
    got, want = np.array(llm.score(ids).logprobs), hf_log_probs(path, ids)
    bound = logprob_tolerance(llm.config, len(ids), llm.forward(ids))
    print(f"{kind}: {len(ids) - 1} tokens, max |log-prob diff| {np.abs(got - want).max():.2e} (tolerance {bound:.1e})")
    assert got.shape == want.shape and np.abs(got - want).max() <= bound


def test_the_perplexity_command_equals_hf(checkpoints, tmp_path):
    path = checkpoints("qwen3_5")
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    result = run_cli("perplexity", "--model", str(path), "--input", str(text_file))
    assert result.returncode == 0, result.stderr[-2000:]
    llm = npqwen.load(path)
    ids = llm.tokenizer.encode(TEXT)
    want = math.exp(-hf_log_probs(path, ids).mean())
    got = float(re.match(r"perplexity (\S+) ", result.stdout).group(1))
    print(f"perplexity: npqwen {got:.4f}, HF {want:.4f}")
    # exp(-mean log p): the mean log p within the log-probabilities' bar, then printed to 4 decimals
    assert abs(got - want) <= logprob_tolerance(llm.config, len(ids), llm.forward(ids)) * want + 5e-5


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_says_which_layers_are_linear_and_what_a_request_holds(checkpoints, kind):
    path = checkpoints(kind)
    text = describe(str(path))
    llm = npqwen.load(path)
    cfg = llm.config
    linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    states = Engine(llm, kv_cache_tokens=256, page_size=16, max_batch_size=3).kv.states   # what the engine holds
    per_slot = (states.conv.nbytes + states.recurrent.nbytes) // states.num_slots
    conv, recurrent = list(states.conv.shape[2:]), list(states.recurrent.shape[2:])
    print(text[text.index("hybrid layers"):text.index("weights (")])
    for line in (f"linear attention           {len(linear)} layers: {linear}",
                 f"full attention             {len(full)} layers: {full}",
                 f"state per request          {per_slot:,} bytes (conv {conv} and delta rule {recurrent} per "
                 "linear layer"):
        assert line in text, line
    assert len(linear) == 3 and recurrent == [cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                              cfg.linear_value_head_dim]


def test_trace_lists_the_linear_steps_and_draws_only_full_attention(checkpoints, tmp_path):
    path = checkpoints("qwen3_next")
    result = run_cli("trace", "--model", str(path), "--prompt", "hi there", "--plot-attention",
                     str(tmp_path / "a.png"), "--layer", "3")
    assert result.returncode == 0 and (tmp_path / "a.png").is_file(), result.stderr[-2000:]
    assert "layers.0.linear_attn.in_proj_qkvz" in result.stdout and "linear_attn.in_proj_qkv " not in result.stdout
    result = run_cli("trace", "--model", str(path), "--prompt", "hi there", "--plot-attention",
                     str(tmp_path / "b.png"), "--layer", "1")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "layer 1 is a Gated DeltaNet linear-attention layer" in result.stderr and "layer: [3]" in result.stderr
    assert not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_the_logit_lens_equals_hf_hidden_states_through_its_norm_and_head(checkpoints, kind):
    """Each layer's lens against HF's: its hidden states through HF's own final norm (1 + weight) and lm_head."""
    path = checkpoints(kind)
    llm = npqwen.load(path)
    ids = llm.tokenizer.encode(TEXT)[:20]
    lens = llm.logit_lens(ids, top_k=3)
    hf = hf_model(path)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        hidden = [*out.hidden_states[1:-1], None]        # HF's last entry is after the final norm: use its logits
        worst = 0.0
        for i, h in enumerate(hidden):
            logits = out.logits[0] if h is None else hf.lm_head(hf.model.norm(h))[0]
            probs = torch.softmax(logits.double(), -1).numpy()
            want = probs[np.arange(len(ids) - 1), ids[1:]]
            worst = max(worst, np.abs(lens.next_probs[i] - want).max() / want.max())
            assert np.array_equal(lens.top_ids[i], np.argsort(-probs, -1, kind="stable")[:, :3]), i
        bound = logprob_tolerance(llm.config, len(ids), out.logits[0].numpy())   # p moves by p times log p's error
    print(f"{kind}: largest relative difference of a layer's next-token probability {worst:.2e} (tolerance {bound:.1e})")
    assert worst <= bound


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("contrast", [None, 9])
def test_attribution_shares_add_up_to_the_logit(checkpoints, kind, contrast):
    llm = npqwen.load(checkpoints(kind))
    ids = llm.tokenizer.encode(TEXT)[:20]
    a = llm.logit_attribution(ids, 7, contrast=contrast)
    total = a.embed + a.attn.sum() + a.mlp.sum()
    print(f"{kind}: logit {a.logit:.6f}, sum of the shares {total:.6f}; heads {a.heads.shape}")
    assert_shares_add_up(llm, a, total)
    cfg = llm.config
    assert a.heads.shape == (cfg.num_hidden_layers, max(cfg.num_attention_heads, cfg.linear_num_value_heads))
