"""`npqwen.load`: a checkpoint directory -> an LLM (model + tokenizer + sampling defaults).

    llm = npqwen.load("Qwen3-0.6B")
    llm.generate("The capital of France is", max_new_tokens=20).text
    for piece in llm.stream("Tell me a story"): print(piece, end="")
    llm.chat([{"role": "user", "content": "Why is the sky blue?"}]).content
"""
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import numpy as np

from .backend import array_module
from .chat_format import opens_reasoning, split_reasoning
from .checkpoint import expected_shapes, load_weights, stored_names
from .checks import check_token_ids
from .comm import SingleProcess
from .config import Qwen3Config
from .embed import embed, read_sentence_transformers
from .engine import Engine
from .engine.run import run
from .errors import NpqwenError
from .features import SAE, check_against, run_saes
from .generate import ChatResult, GenerationResult, ScoreResult
from .hooks import Cache, Hooks, both, check_names
from .hub import resolve_model
from .lens import logit_attribution, logit_lens
from .lora import read_adapter
from .model import Qwen3
from .parallel import agreed, check_split, communicator, rank_0_leads, shards
from .qwen4_exp import Qwen4Exp
from .rerank import rerank
from .sampling_params import SamplingParams, params_of, read_generation_config
from .tokenizer import Tokenizer

DTYPES = {"cpu": ("float32", "float64"), "cuda": ("float32", "float16", "float64")}
SINGLE = SingleProcess()   # one process: the model's communicator, unless it has one (a stand-in model)


class LLM:
    """A loaded Qwen3: `.config`, `.weights` (HF name -> array), `.tokenizer`, `.forward(ids)`,
    `.generate`, `.stream`, `.chat`."""

    def __init__(self, model: Qwen3, tokenizer: Tokenizer | None = None, generation_defaults: dict | None = None,
                 path: Path | None = None, stored_names: dict | None = None):
        self.model = model
        self.comm = getattr(model, "comm", SINGLE)   # the ranks the model is split over (npqwen/comm.py)
        self.config = model.config
        # HF names as the checkpoint spells them: a Qwen3Model checkpoint (Qwen3-Embedding) has no "model."
        # prefix and no lm_head; the model code reads the same arrays under the prefixed names.
        renamed = stored_names is not None and any(k != v for k, v in stored_names.items())
        self.weights = {stored_names[n]: a for n, a in model.weights.items() if n in stored_names} if renamed \
            else model.weights
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults or {}   # from generation_config.json
        self.path = path
        self.embedding_config = read_sentence_transformers(path)   # pooling, prompts (npqwen/embed.py)
        self._engine = None       # made on first use: generate / stream / chat run through it
        self._inbox = {}          # engine outputs that arrived for another stream than the one stepping
        self._loras = {}          # LoRA adapters by name (load_lora); a request names one, or none

    @property
    def engine(self):
        """The engine behind generate / stream / chat (default sizes; see npqwen.Engine to choose them)."""
        if self._engine is None:
            self._engine = Engine(self)
        return self._engine

    def forward(self, token_ids, cache=None, last_only=False, recorder=None, lora: str | None = None):
        """Logits (T, V) in the compute dtype, through the LoRA adapter named `lora` if given; see Qwen3.forward."""
        adapter = None if lora is None else self.lora_adapter(lora)
        return self.model.forward(token_ids, cache=cache, last_only=last_only, recorder=recorder,
                                  **({"lora": adapter} if adapter is not None else {}))

    @property
    def loras(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return list(self._loras)

    def load_lora(self, name: str, path) -> "LLM":
        """Load a PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) under `name`;
        requests that name it (lora="name") go through it, the others through the base model (npqwen/lora.py)."""
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise NpqwenError(f"a LoRA adapter's name is a non-empty string without surrounding spaces, got {name!r}")
        if name in self._loras:
            raise NpqwenError(f"a LoRA adapter named {name!r} is loaded already; unload it first (llm.unload_lora)")
        if self.comm.size > 1:
            raise NpqwenError("LoRA adapters are not applied under tensor parallelism; merge the adapter into the "
                              "base (npqwen merge-lora) and load the result")
        self._loras[name] = read_adapter(path, name, self.model)   # checked whole before it is added
        return self

    def unload_lora(self, name: str):
        """Forget the adapter `name`; requests already running with it finish with it."""
        self.lora_adapter(name)
        del self._loras[name]

    def lora_adapter(self, name: str):
        """The loaded LoraAdapter called `name`, or an error that names the loaded ones."""
        if name not in self._loras:
            loaded = ", ".join(self._loras) or "none"
            raise NpqwenError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}); load one with "
                              f"llm.load_lora(name, path) or npqwen.load(..., lora={{name: path}})")
        return self._loras[name]

    def run_with_cache(self, prompt, names=None, hooks=None):
        """(logits (T, V), cache): one forward pass over `prompt` (text or token ids) that keeps a host copy
        of each step's array under its name (cache[name]; cache.keys() lists them). `names`, a list or a
        function of the name, keeps only those; `hooks` as for run_with_hooks (the cache keeps their
        result). See npqwen/hooks.py."""
        if names is not None and not callable(names):
            names = [names] if isinstance(names, str) else list(names)
            check_names(names, self.config, "cache")
        cache, hooked = Cache(names), None if hooks is None else Hooks(hooks, self.config)
        return self.forward(self.prompt_ids(prompt), recorder=both(cache, hooked)), cache

    def run_with_hooks(self, prompt, hooks):
        """Logits (T, V) of `prompt` with `hooks` ({name: fn} or [(name, fn)]) called as fn(array, name): an
        array of the same shape and dtype it returns replaces that value from then on; None leaves it."""
        return self.forward(self.prompt_ids(prompt), recorder=Hooks(hooks, self.config))

    def run_with_saes(self, prompt, saes, top: int = 10):
        """(logits (T, V), runs): one forward pass over `prompt`, and for each SAE or transcoder (npqwen.load_sae)
        a features.FeatureRun: its `top` strongest features per token (indices, values), all activations, the
        reconstruction (a transcoder's: the replacement MLP's output) and its error. See npqwen/features.py."""
        saes = [saes] if isinstance(saes, SAE) else list(saes)
        for sae in saes:
            if not isinstance(sae, SAE):
                raise NpqwenError(f"run_with_saes takes SAEs from npqwen.load_sae, got {type(sae).__name__}")
            check_against(sae, self.config)
        logits, cache = self.run_with_cache(prompt, names=sorted({n for s in saes for n in (s.reads, s.writes)}))
        return logits, run_saes(cache, saes, top)

    def logit_lens(self, prompt, top_k: int = 5):
        """Every layer's block output through the final norm and lm_head, at every position (npqwen/lens.py)."""
        return logit_lens(self, prompt, top_k)

    def logit_attribution(self, prompt, target, contrast=None, position: int = -1):
        """How much of `target`'s logit (minus `contrast`'s) each part writes: embedding, attention and MLP of
        each layer, each head (npqwen/lens.py)."""
        return logit_attribution(self, prompt, target, contrast, position)

    def new_cache(self, capacity: int):
        return self.model.new_cache(capacity)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.generation_defaults.get("eos_token_id") or list(self.config.eos_token_ids)

    @rank_0_leads
    def generate(self, prompt, params: SamplingParams | int | None = None, steering=None, *,
                 lora: str | None = None, feature_edits=None,
                 **sampling) -> GenerationResult | list[GenerationResult]:
        """Complete `prompt` (text, used as is, or token ids) as `params` (an npqwen.SamplingParams) say,
        or its fields given as keyword arguments (max_new_tokens=20, temperature=0, stop=..., seed=...);
        a number in params' place is max_new_tokens. Sampling values not given are the checkpoint's
        (generation_config.json); temperature=0 is greedy.

        A list of prompts (strings, or token-id lists) runs them all at once through the engine
        and returns their results in the same order.

        Structured output: at most one of `json_schema` (a dict or its JSON text), `regex` (the whole
        answer matches it), `choice` (a list of strings: the answer is one of them) or `grammar`
        (llguidance's Lark, or GBNF) makes every answer match it (npqwen/structured.py).

        Steering: `steering=[{"layer": L, "vector": v, "scale": s}]` adds s*v to the residual stream after
        block L, at every position and step, for this request only (npqwen/steering.py).
        `lora` names a loaded LoRA adapter (load_lora) to generate through. `feature_edits=[{"sae": sae,
        "feature": f, "clamp": v}]` (or "zero": True, "scale": s) sets an SAE feature (npqwen/features.py).
        """
        params = params_of(params, sampling, self.generate)   # checked now, before anything runs
        if is_prompt_list(prompt):
            return self._generate_many(prompt, params, steering, lora, feature_edits)
        result = GenerationResult("", [], "length")
        for _ in self.stream(prompt, params, result=result, steering=steering, lora=lora,
                             feature_edits=feature_edits):
            pass
        return result

    @rank_0_leads
    def stream(self, prompt, params: SamplingParams | int | None = None, *, result: GenerationResult | None = None,
               steering=None, lora: str | None = None, feature_edits=None, **sampling):
        """Like generate (one prompt), but yields text pieces as they come; `result`, if given, is filled
        in. SamplingParams' `thinking`: the answer opens with Qwen3's <think> reasoning, which a
        constraint leaves free."""
        request = self.engine.new_request(prompt, params_of(params, sampling, self.stream), steering=steering,
                                          lora=lora, feature_edits=feature_edits)   # checked now
        return self._pieces(request, result if result is not None else GenerationResult("", [], "length"))

    def score(self, text, lora: str | None = None) -> ScoreResult | list[ScoreResult]:
        """How likely the model finds `text` (a string, used as is, or token ids): each token's log
        probability given the tokens before it, under the model's own distribution (the raw logits'
        log-softmax, no sampling transform); the first token has no context and is not scored.
        A list of texts runs them all at once through the engine and returns their results in order.
        The prompt's positions are scored chunk by chunk as the engine reads it (StepOutput.prompt_logprobs)."""
        many = is_prompt_list(text)
        params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0)
        requests = [self.engine.new_request(t, params, lora=lora) for t in (text if many else [text])]
        scores = {r.request_id: [] for r in requests}
        with closing(run(self.engine, requests, self._inbox)) as outputs:
            for out in outputs:
                scores[out.request_id] += [lp for lp, _, _ in out.prompt_logprobs or []]
        results = [ScoreResult(list(r.prompt_ids), scores[r.request_id]) for r in requests]
        return results if many else results[0]

    def chat_prompt(self, messages, enable_thinking: bool = True, tools=None) -> str:
        """The chat template applied to `messages` (a str is one user message), ready for generation."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self._tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                     enable_thinking=enable_thinking, tools=tools)

    @rank_0_leads
    def chat(self, messages, enable_thinking: bool = True, tools=None, stream_to=None,
             params: SamplingParams | None = None, steering=None, lora: str | None = None,
             feature_edits=None, **sampling) -> ChatResult:
        """Answer the conversation; the <think> reasoning comes back apart from the final content.

        `params` (an npqwen.SamplingParams) or its fields as keyword arguments, as for generate.
        `stream_to`, if given, is called with each text piece as it is generated. A constraint
        (json_schema=, regex=, choice=, grammar=) applies to the content: with thinking on, from the
        first token after "</think>" (the reasoning stays free); with it off, from the first token.
        `thinking_budget=N` ends the reasoning after N tokens ("\\n</think>\\n\\n" is written for the
        model); a constrained answer's reasoning ends at the latest at half of max_new_tokens.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        params = params_of(params, sampling, self.chat)
        if params.thinking != enable_thinking:
            params = replace(params, thinking=enable_thinking)
        prompt = self.chat_prompt(messages, enable_thinking, tools)
        result = ChatResult("", [], "length")
        for piece in self.stream(prompt, params, result=result, steering=steering, lora=lora,
                                 feature_edits=feature_edits):
            if stream_to is not None:
                stream_to(piece)
        result.reasoning, result.content = split_reasoning(result.text, enable_thinking, opens_reasoning(prompt))
        result.messages = list(messages) + [{"role": "assistant", "content": result.content}]
        return result

    @rank_0_leads
    def embed(self, texts, instruction: str | None = None, prompt_name: str | None = None, dimensions=None,
              normalize: bool | None = None) -> np.ndarray:
        """(n, d) float32 embeddings of texts (a string, token ids, or a list of either), as
        sentence-transformers computes them from this checkpoint's files; see npqwen/embed.py.

        instruction="..." makes Qwen3-Embedding's query form "Instruct: {instruction}\nQuery:{text}";
        prompt_name uses one of the checkpoint's prompts; dimensions=d keeps the first d values;
        normalize (default: as the checkpoint says) makes unit-length rows after that.
        """
        return embed(self, texts, instruction, prompt_name, dimensions, normalize)

    @rank_0_leads
    def rerank(self, query: str, documents, instruction: str | None = None) -> np.ndarray:
        """One relevance score in [0, 1] per document: Qwen3-Reranker's p(yes); see npqwen/rerank.py."""
        return rerank(self, query, documents, instruction)

    @property
    def kind(self) -> str:
        """What the checkpoint was made for: "embedding", "reranker" or "generation" (embed and rerank run
        on any; generation needs an lm_head, which a Qwen3Model checkpoint lacks)."""
        if self.embedding_config.model_type == "CrossEncoder":
            return "reranker"
        if self.embedding_config.is_embedding_model or not getattr(self.model, "has_lm_head", True):
            return "embedding"
        return "generation"

    @rank_0_leads
    def run_prefill_only(self, requests: list, engine=None) -> list:
        """Run prefill-only requests (engine.new_embedding_request / new_scoring_request) to the end on
        `engine` (default: llm.engine): their final outputs, in order. Outputs of other requests of
        llm.engine wait in the inbox for their own streams."""
        engine = self.engine if engine is None else engine
        with closing(run(engine, requests, self._inbox if engine is self._engine else None)) as outputs:
            done = {out.request_id: out for out in outputs if out.finished}
        return [done[r.request_id] for r in requests]

    def save(self, directory, dtype: str = "F32"):
        """Write a Hugging Face checkpoint directory (config, weights, tokenizer, generation defaults)."""
        import json

        from .backend import to_numpy
        from .checkpoint import save_safetensors
        from .ple import NgramTable, hf_buffers
        from .weights import is_compact

        if self.comm.size > 1:
            raise NpqwenError("llm.save writes the whole model, and this rank holds only its part of it (tensor "
                              "parallelism); save from a model loaded in one process")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        tensors = {name: a if is_compact(a) else to_numpy(a) for name, a in self.weights.items()   # compact: widened
                   # one at a time as it is written
                   if not (name == "lm_head.weight" and self.config.tie_word_embeddings or isinstance(a, NgramTable))}
        for name, table in self.weights.items():   # Qwen4-Exp's PLE tables: their parts, as the shards transformers
            if isinstance(table, NgramTable):      # writes (a float32 part is read from its mapped file as written)
                tensors.update({f"{name[:-len('weight')]}shard_{j}.weight": table.widen(part)
                                for j, part in enumerate(table.parts)})
        if self.config.qwen4_exp:   # and their hash constants, which transformers keeps as buffers and writes too
            tensors.update(hf_buffers(self.config))
        save_safetensors(directory / "model.safetensors", tensors, dtype)
        defaults = self.generation_defaults
        sampling = {k: defaults[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in defaults}
        generation = {**({"do_sample": True} if sampling else {}), **sampling,
                      **({"eos_token_id": self.eos_token_ids} if self.eos_token_ids else {})}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if self.tokenizer is not None:
            self.tokenizer.save(directory)
        return directory

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise NpqwenError(f"{self.path}: no tokenizer.json, so text prompts cannot be encoded; "
                              f"add the checkpoint's tokenizer.json and tokenizer_config.json (from the same hub repo), "
                              f"or pass token ids (Python API only)")
        return self.tokenizer

    def prompt_ids(self, prompt) -> list[int]:
        """A prompt as token ids: text is tokenized as is; token ids are checked as forward checks them."""
        if isinstance(prompt, str):
            return self._tokenizer().encode(prompt)
        if not isinstance(prompt, (list, tuple, range)) and not hasattr(prompt, "ndim"):
            hint = " (decode bytes to str first)" if isinstance(prompt, bytes) else ""
            raise NpqwenError(f"a prompt is a string, a 1-D sequence of integer token ids, or a list of such "
                              f"prompts; got {type(prompt).__name__} {str(prompt)[:40]!r}{hint}")
        return check_token_ids(prompt, self.config.vocab_size).tolist()

    def _pieces(self, request, result: GenerationResult):
        """The text pieces of one request as the engine makes them; `result` filled in at the end. A
        failed request (its constraint) raises its error."""
        with closing(run(self.engine, [request], self._inbox)) as outputs:
            for out in outputs:
                if out.text:
                    yield out.text
                if out.finished:
                    vars(result).update(vars(out.result))
                    if out.result.error is not None:
                        raise NpqwenError(out.result.error)

    def _generate_many(self, prompts, params: SamplingParams, steering=None,
                       lora: str | None = None, feature_edits=None) -> list[GenerationResult]:
        """Every prompt through the engine at once; their results in order. A prompt that cannot run,
        or fails, is named by its index; the others are then stopped."""
        requests = []
        for prompt in prompts:
            try:
                requests.append(self.engine.new_request(prompt, params, steering=steering, lora=lora,
                                                        feature_edits=feature_edits))
            except NpqwenError as e:
                raise NpqwenError(f"prompt {len(requests)}: {e}") from e
        index = {r.request_id: i for i, r in enumerate(requests)}
        results = {}
        with closing(run(self.engine, requests, self._inbox)) as outputs:
            for out in outputs:
                if out.finished:
                    if out.result.error is not None:
                        raise NpqwenError(f"prompt {index[out.request_id]}: {out.result.error}")
                    results[out.request_id] = out.result
        return [results[r.request_id] for r in requests]


def is_prompt_list(prompt) -> bool:
    """A list of prompts (strings or token-id sequences), as opposed to one prompt of token ids."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple, range, np.ndarray)) for p in prompt))


def check_device_dtype(device: str, dtype: str):
    """The devices and compute dtypes npqwen runs; checked before anything slow."""
    if device not in DTYPES:
        raise NpqwenError(f"unknown device {device!r}: use 'cpu' or 'cuda'")
    if dtype not in DTYPES[device]:
        hint = " (NumPy float16 matmuls are ~100x slower than float32)" if dtype == "float16" else ""
        raise NpqwenError(f"dtype {dtype!r} is not supported on {device}{hint}; use one of "
                          f"{', '.join(DTYPES[device])}")


def load(path, device: str = "cpu", dtype: str = "float32", tensor_parallel=False, lora: dict | None = None,
         weights: str = "auto") -> LLM:
    """Load a Qwen3 checkpoint onto `device` ("cpu" or "cuda") in `dtype`.

    `path` is a Hugging Face checkpoint directory, a hub id such as "Qwen/Qwen3-0.6B" found in
    the HF cache (or downloaded when huggingface_hub is installed and online), or "tiny" ("tiny-moe",
    "tiny-embedding", "tiny-reranker") for the built-in tiny Qwen3 (Qwen3-MoE, embedding and reranker
    twins) with random weights (see npqwen/tiny.py).

    tensor_parallel=True, on every rank of `mpiexec -n N python script.py`: each rank reads only its
    part of every layer (npqwen/parallel.py), and forward, generate and npqwen.Engine give the same
    results on every rank. A communicator (npqwen/comm.py) may be given instead of True.

    lora={"name": path, ...} loads PEFT LoRA adapters (llm.load_lora); a request picks one by name.

    weights: how the matrices are kept (docs/weights.md). "auto" (the default) is float32 where that fits the
    free memory and the file holds no quantized matrix, else as stored; "stored" as the file holds them
    (bfloat16 memory-mapped, Qwen's FP8, npqwen quantize's int8 / ggml blocks); "float32"; or a format to
    convert to while loading: "bfloat16", "float16", "int8", "q8_0", "q4_0", "q4_k".
    """
    check_device_dtype(device, dtype)
    comm = communicator(tensor_parallel, device)
    llm = agreed(comm, lambda: load_part(path, device, dtype, comm, weights))   # a rank that fails stops them all
    if lora is not None and not isinstance(lora, dict):
        raise NpqwenError(f"lora must be a dict of adapter name -> adapter directory, got {type(lora).__name__}")
    for name, adapter_path in (lora or {}).items():
        llm.load_lora(name, adapter_path)
    return llm


def load_gguf(path, xp, dtype: str, comm, weights: str) -> LLM:
    """A GGUF file (llama.cpp, Ollama): npqwen/gguf_file.py maps its metadata, tokenizer and tensors to HF's."""
    from .gguf_file import load_gguf_weights, read_gguf

    raw_config, tensors, tokenizer = read_gguf(path)
    config = Qwen3Config.from_dict(raw_config, source=str(path))
    check_split(config, comm.size)
    parts = None if comm.size == 1 else shards(config, expected_shapes(config), comm.size, comm.rank)
    arrays, fused = load_gguf_weights(config, tensors, xp, np.dtype(dtype), path, weights, parts)
    return LLM((Qwen4Exp if config.qwen4_exp else Qwen3)(config, arrays, fused, comm), tokenizer, {}, path)


def load_part(path, device: str, dtype: str, comm, weights: str = "auto") -> LLM:
    """This rank's part of the model (the whole model in one process)."""
    from .tiny import BUILTIN

    if str(path) in BUILTIN:
        from .tiny import TINY_GENERATION, tiny_embedding_config, tiny_model, tiny_tokenizer
        model = tiny_model(device, dtype, str(path), comm, weights)
        llm = LLM(model, tiny_tokenizer(str(path)), dict(TINY_GENERATION), None)
        llm.embedding_config = tiny_embedding_config(str(path))   # tiny-embedding, tiny-reranker: as their files say
        return llm
    path = resolve_model(path)
    xp = array_module(device)
    if path.is_file():   # a GGUF file (resolve_model checked): config, tokenizer and weights in one file
        return load_gguf(path, xp, dtype, comm, weights)
    config = Qwen3Config.from_json(path / "config.json")
    check_split(config, comm.size)
    parts = None if comm.size == 1 else shards(config, expected_shapes(config), comm.size, comm.rank)
    arrays, fused = load_weights(path, config, xp, np.dtype(dtype), parts, weights)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    model = (Qwen4Exp if config.qwen4_exp else Qwen3)(config, arrays, fused, comm)   # a second family, its own file
    return LLM(model, tokenizer, read_generation_config(path), path, stored_names(path))
