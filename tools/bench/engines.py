"""The engines under test (npqwen and HF transformers' Qwen3ForCausalLM), the checkpoint they load,
and the helpers every suite that drives npqwen.Engine shares."""
import json
import os
import sys
import time
from pathlib import Path

ENGINES = ("npqwen", "hf-float32", "hf-bfloat16")       # the default set
# Every engine --engines takes: hf-float16 too, HF's native dtype on a GPU (on a CPU torch has no fast float16);
# llama.cpp, node-llama-cpp's prebuilt library, for the weights suite alone (on GGUF files of its own).
KNOWN_ENGINES = ENGINES + ("hf-float16", "llama.cpp")
PEERS = ("hf-bfloat16", "hf-float32", "hf-float16")     # npqwen's figures are ratios over these, where they ran
CACHE_DIR = Path(os.environ.get("NPQWEN_CACHE", Path.home() / ".cache" / "npqwen"))


def default_checkpoint(moe: bool = False, hybrid: bool = False) -> Path:
    """A random-weight bf16 checkpoint of the exact Qwen3-0.6B shape (with moe: of Qwen3-30B-A3B's layers,
    2 of them; with hybrid: of Qwen3.5-0.8B's text model), written once by npqwen's own writer."""
    from npqwen.checkpoint import save_safetensors
    from npqwen.config import (QWEN3_0_6B_CONFIG, QWEN3_0_6B_GENERATION_CONFIG, QWEN3_5_0_8B_TEXT_CONFIG,
                               QWEN3_30B_A3B_CONFIG)

    name, config = "qwen3-0.6b-random", QWEN3_0_6B_CONFIG
    if moe:
        name, config = "qwen3-30b-a3b-2-layers-random", dict(QWEN3_30B_A3B_CONFIG, num_hidden_layers=2,
                                                             max_window_layers=2)
    if hybrid:
        name, config = "qwen3.5-0.8b-random", QWEN3_5_0_8B_TEXT_CONFIG
    path = CACHE_DIR / name
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        return path
    print(f"[bench] building a random {name} checkpoint in {path} (once)", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(path / "model.safetensors.tmp", random_weights(config), "BF16")
    (path / "model.safetensors.tmp").rename(path / "model.safetensors")
    (path / "generation_config.json").write_text(json.dumps(QWEN3_0_6B_GENERATION_CONFIG, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def random_weights(config: dict) -> dict:
    """Every tensor of a checkpoint of `config`, float32, from a fixed seed: norms 1, the rest N(0, 0.02)."""
    import numpy as np

    from npqwen.checkpoint import expected_shapes
    from npqwen.config import Qwen3Config

    rng = np.random.default_rng(0)
    return {name: np.ones(shape, np.float32) if name.endswith("norm.weight")
            else rng.standard_normal(shape, dtype=np.float32) * 0.02
            for name, shape in expected_shapes(Qwen3Config.from_dict(config)).items()}


def builtin_checkpoint(name: str) -> Path:
    """A built-in model (`--model tiny`, tiny-moe, ...) written once as a checkpoint directory, float32,
    so that the HF engines load the same weights as npqwen: a quick try of the whole command."""
    import numpy as np

    import npqwen
    from npqwen.checkpoint import expected_shapes, save_safetensors
    from npqwen.tiny import BUILTIN, TINY_GENERATION

    path = CACHE_DIR / f"builtin-{name}"
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    llm = npqwen.load(name)
    tensors = {n: np.asarray(llm.weights[n], np.float32) for n in expected_shapes(llm.config)}
    save_safetensors(path / "model.safetensors.tmp", tensors, "F32")
    llm.tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": llm.tokenizer.chat_template,
                                                            **llm.tokenizer.special_tokens}))
    (path / "generation_config.json").write_text(json.dumps(TINY_GENERATION, indent=2))
    (path / "config.json").write_text(json.dumps(dict(BUILTIN[name], architectures=[
        "Qwen3MoeForCausalLM" if BUILTIN[name]["model_type"] == "qwen3_moe" else "Qwen3ForCausalLM"]), indent=2))
    (path / "model.safetensors.tmp").rename(path / "model.safetensors")   # last: a whole checkpoint or none
    return path


def load_engine(args):
    """The engine this worker measures (args.worker names it), loaded once for all its suites."""
    if args.worker == "llama.cpp":
        raise SystemExit("the llama.cpp engine runs the weights suite only: --suites weights")
    return NpqwenEngine(args) if args.worker == "npqwen" else HFEngine(args)


def kv_cache_bytes(config, capacity: int, itemsize: int) -> int:
    """Keys and values of every layer for `capacity` positions (HF's config or npqwen's: same field names)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * capacity * itemsize


def decode_rate(steps: list[float]) -> float:
    """Tokens/s of a typical decode step: 1 / the median step time, which a burst of noise from
    other tenants of a shared machine moves far less than the mean."""
    return 1.0 / sorted(steps)[len(steps) // 2]


class NpqwenEngine:
    def __init__(self, args):
        import npqwen
        from npqwen.generate import decode_one_token, prefill

        self.name = args.worker
        self.llm = npqwen.load(args.model, device=args.device, dtype=args.dtype)
        self.model, self._prefill, self._decode = self.llm.model, prefill, decode_one_token
        self.vocab_size = self.llm.config.vocab_size
        self.probe, self.bandwidth = None, []   # a bandwidth probe runs every 8 decode steps, if set
        unique = {id(a): a for a in self.llm.weights.values()}.values()
        self.sizes = {"weight_bytes": sum(a.nbytes for a in unique), "params": sum(a.size for a in unique)}

    def prefill(self, ids, capacity):
        cache = self.model.new_cache(capacity)
        return int(self._prefill(self.model, ids, cache).argmax())

    def decode(self, ids, new_tokens) -> float:
        cache = self.model.new_cache(len(ids) + new_tokens)
        token = int(self._prefill(self.model, ids, cache).argmax())
        steps = []
        for step in range(new_tokens - 1):
            if self.probe is not None and step % 8 == 0:   # streaming bandwidth, under the same conditions
                self.bandwidth.append(self.probe())
            started = time.perf_counter()
            token = int(self._decode(self.model, token, cache).argmax())
            steps.append(time.perf_counter() - started)
        return decode_rate(steps)

    def kv_bytes(self, capacity) -> int:
        return kv_cache_bytes(self.model.config, capacity, self.model.dtype.itemsize)


class HFEngine:
    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

        torch.set_num_threads(args.threads)
        self.name, self.torch = args.worker, torch
        dtype = getattr(torch, args.worker.split("-")[1])
        self.device = args.hf_device or args.device
        model_type = json.loads((Path(args.model) / "config.json").read_text()).get("model_type")
        model_class = {"qwen3_moe": Qwen3MoeForCausalLM, "qwen3": Qwen3ForCausalLM}.get(model_type,
                                                                                         AutoModelForCausalLM)
        self.model = model_class.from_pretrained(args.model, dtype=dtype).eval().to(self.device)
        self.vocab_size = self.model.config.vocab_size
        params = {p.data_ptr(): p for p in self.model.parameters()}.values()
        self.sizes = {"weight_bytes": sum(p.numel() * p.element_size() for p in params),
                      "params": sum(p.numel() for p in params)}
        self.itemsize = torch.finfo(dtype).bits // 8

    def prefill(self, ids, capacity):
        with self.torch.inference_mode():
            x = self.torch.tensor([ids], device=self.device)
            out = self.model(x, use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax()), out

    def decode(self, ids, new_tokens) -> float:
        token, out = self.prefill(ids, len(ids) + new_tokens)
        cache = getattr(out, "cache", None) or out.past_key_values
        steps = []
        with self.torch.inference_mode():
            for _ in range(new_tokens - 1):
                started = time.perf_counter()
                out = self.model(self.torch.tensor([[token]], device=self.device), past_key_values=cache,
                                 use_cache=True)
                cache = getattr(out, "cache", None) or out.past_key_values
                token = int(out.logits[0, -1].argmax())
                steps.append(time.perf_counter() - started)
        return decode_rate(steps)

    def kv_bytes(self, capacity) -> int:
        return kv_cache_bytes(self.model.config, capacity, self.itemsize)


# ---------------------------------------------------------------------------- driving npqwen.Engine

def whole_pages(positions: int) -> int:
    """A KV pool size for npqwen.Engine: positions rounded up to whole pages."""
    from npqwen.engine.engine import DEFAULT_PAGE_SIZE as P

    return -(-positions // P) * P


def add_fixed(engine, ids, max_new_tokens):
    """Queue a greedy request that runs to exactly max_new_tokens: its eos ids are cleared (a random
    model samples eos whenever it likes), so every engine does the same work. The Request."""
    rid = engine.add_request(ids, max_new_tokens=max_new_tokens, temperature=0)
    req = engine.requests[rid]
    req.eos_ids = frozenset()
    return req


def run_to_end(engine) -> int:
    """Step the engine until every request is done; the number of steps."""
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def warm_up(engine):
    """One short request first, so no timed run pays for first calls (it fills no page: nothing is cached)."""
    add_fixed(engine, list(range(16)), 2)
    run_to_end(engine)
