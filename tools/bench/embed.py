"""embed: --embed-texts (64) texts of --embed-lens (16-512) tokens embedded at the Qwen3-Embedding-0.6B
shape: npqwen's llm.embed (every text packed into the engine's steps, no padding) against
sentence-transformers' encode in float32 and bfloat16 with its default batching (sorted by length,
batches of 32, each padded to its longest text), and sentence-transformers float32 one text at a time
(no padding at all), which measures what the padding costs it. Each pass over the texts is timed
--repeats times and the best counts (the one-per-batch pass once); npqwen's each on a new engine,
so that no pass finds the texts in the prefix cache of the one before.

The checkpoint is a random Qwen3Model of Qwen3-Embedding-0.6B's shape (vocab 151,669) in the hub's
layout (sentence-transformers' older files: last-token pooling, Normalize, the query prompt), with the
real Qwen3 tokenizer and Qwen3-Embedding's <|endoftext|>-appending post-processor, built once; the
texts are cuts of a fixed passage, tokenized the same way by both (the same tokenizer.json).
"""
import json
import sys
import time
from pathlib import Path

from tools.bench.engines import CACHE_DIR
from tools.bench.serving import at_least_1

NAME, WORKER, NEEDS = "embed", "serving", ()
OWN_MODEL = True      # its workers load the embedding checkpoint below, not --model
SEED = 0
TARGETS = [  # (figure, comparison, threshold, label)
    ("embed_vs_hf-float32", ">=", 1.5, "embed: npqwen texts/s vs sentence-transformers float32"),
    ("embed_vs_hf-bfloat16", ">=", 0, "embed: npqwen texts/s vs sentence-transformers bfloat16"),
]
PASSAGE = ("The capital of China is Beijing. Gravity is a force that attracts two bodies towards each other; "
           "it gives weight to physical objects and keeps the planets moving around the sun. Retrieval pipelines "
           "embed every passage once and each query as it comes, then rerank the best few. 北京是中国的首都。 ")
COLUMNS = {"npqwen": "npqwen float32", "hf-float32": "ST float32", "hf-bfloat16": "ST bfloat16"}


def lens(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split("-"))
    if not 1 <= lo <= hi:
        raise ValueError(text)
    return lo, hi


def add_arguments(p):
    p.add_argument("--embed-texts", type=at_least_1, default=64, help="embed: how many texts")
    p.add_argument("--embed-lens", type=lens, default=(16, 512), help="embed: token counts, uniform in LO-HI")
    p.add_argument("--embed-model", help="embed: a Qwen3-Embedding checkpoint directory (default: a random one "
                                         "of the 0.6B shape, built once)")


def runs_on(engine, args) -> bool:
    return True


def run(engine, args, rng) -> dict:
    """One engine's pass over the texts (engine: the worker's name; the suite loads its own model)."""
    path = Path(args.embed_model) if args.embed_model else embedding_checkpoint()
    texts = workload(path, args)
    out = {}
    if engine == "npqwen":
        import npqwen

        started = time.perf_counter()
        llm = npqwen.load(path, device=args.device, dtype=args.dtype)
        out["load_s"] = time.perf_counter() - started

        def fresh_run(some):   # a new engine each time: the texts are new to its prefix cache
            llm._engine = None
            return llm.embed(some)
        fresh_run(texts[:2])                                     # warm-up: first calls, a page touched
        out["seconds"] = best_time(lambda: fresh_run(texts), args.repeats)
        vectors = fresh_run(texts[:1])
        tokens = [len(x) for x in npqwen.embed.embedding_inputs(llm, texts)]
    else:
        import numpy as np
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(args.threads)
        started = time.perf_counter()
        st = SentenceTransformer(str(path), device=args.device, model_kwargs={"dtype": getattr(torch, engine[3:])})
        out["load_s"] = time.perf_counter() - started
        st.encode(texts[:2])
        out["seconds"] = best_time(lambda: st.encode(texts), args.repeats)   # its defaults: batches of 32, sorted
        vectors = st.encode(texts[:1])
        tokens = token_counts(st, texts)
        out["padded_tokens"] = padded_tokens(st, texts, tokens)
        if engine == "hf-float32":                               # no padding at all: one text per batch
            started = time.perf_counter()
            st.encode(texts, batch_size=1)
            out["unpadded_seconds"] = time.perf_counter() - started
        vectors = np.asarray(vectors)
    out.update(texts=len(texts), tokens=sum(tokens), dims=int(vectors.shape[1]), first=vectors[0, :4].tolist(),
               checkpoint=str(path), shortest=min(tokens), longest=max(tokens))
    from tools.bench.machine import peak_rss_bytes

    out["peak_rss_bytes"] = peak_rss_bytes()
    return {"embed": {engine: out}}


def best_time(fn, n) -> float:
    """The shortest of n timed runs (the caller warmed up on two texts: a whole extra pass costs minutes)."""
    times = []
    for _ in range(max(n, 1)):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def token_counts(st, texts) -> list[int]:
    """Each text's tokens as sentence-transformers feeds them (its tokenizer, special tokens included)."""
    return [len(st.tokenizer(t)["input_ids"]) for t in texts]


def padded_tokens(st, texts, tokens) -> int:
    """Positions sentence-transformers' default batching computes: it sorts by text length (characters,
    longest first), cuts batches of 32 and pads each to its longest text."""
    import numpy as np

    order = np.argsort([-st._input_length(t) for t in texts]).tolist()   # as SentenceTransformer.encode sorts
    batches = [order[i:i + 32] for i in range(0, len(order), 32)]
    return sum(len(b) * max(tokens[i] for i in b) for b in batches)


def workload(path: Path, args) -> list[str]:
    """--embed-texts texts whose token counts are uniform in --embed-lens (fixed seed), cut from PASSAGE."""
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tokenizer.encode(PASSAGE * 200, add_special_tokens=False).ids
    lo, hi = args.embed_lens
    lengths = np.random.default_rng(SEED).integers(lo, hi + 1, args.embed_texts)
    extra = len(tokenizer.encode("", add_special_tokens=True).ids)   # Qwen3-Embedding's <|endoftext|>
    return [tokenizer.decode(ids[13 * i:13 * i + int(n) - extra]) for i, n in enumerate(lengths)]


def embedding_checkpoint() -> Path:
    """A random Qwen3Model of Qwen3-Embedding-0.6B's shape in the hub's layout, written once (no torch)."""
    import numpy as np

    from npqwen.checkpoint import expected_shapes, save_safetensors
    from npqwen.config import QWEN3_0_6B_CONFIG, Qwen3Config

    path = CACHE_DIR / "qwen3-embedding-0.6b-random"
    if (path / "model.safetensors").is_file() and (path / "modules.json").is_file():
        return path
    tokenizer_dir = qwen3_tokenizer_dir()
    print(f"[bench] building a random Qwen3-Embedding-0.6B-shape checkpoint in {path} (once)", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    config = {**QWEN3_0_6B_CONFIG, "vocab_size": 151669}
    rng = np.random.default_rng(SEED)
    shapes = expected_shapes(Qwen3Config.from_dict(config))
    tensors = {name.removeprefix("model."): np.ones(shape, np.float32) if name.endswith("norm.weight")
               else rng.standard_normal(shape, dtype=np.float32) * 0.02 for name, shape in shapes.items()}
    save_safetensors(path / "model.safetensors.tmp", tensors, "BF16")   # Qwen3Model's names, no lm_head
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    def seq(name, type_id):
        return [{"Sequence": {"id": name, "type_id": type_id}}, {"SpecialToken": {"id": "<|endoftext|>",
                                                                                  "type_id": type_id}}]
    endoftext = {"type": "TemplateProcessing", "single": seq("A", 0), "pair": seq("A", 0) + seq("B", 1),
                 "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643],
                                                      "tokens": ["<|endoftext|>"]}}}
    tokenizer["post_processor"] = {"type": "Sequence", "processors": [tokenizer["post_processor"], endoftext]}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    config_text = (tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8")
    (path / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 1024, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
         "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8192, "do_lower_case": False}))
    query = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": query, "document": ""}, "default_prompt_name": None, "similarity_fn_name": "cosine"}))
    (path / "model.safetensors.tmp").rename(path / "model.safetensors")
    (path / "modules.json").write_text(json.dumps(modules, indent=2))   # last: the checkpoint is complete
    return path


def qwen3_tokenizer_dir() -> Path:
    import os

    path = Path(os.environ.get("NPQWEN_QWEN3_TOKENIZER", Path(__file__).resolve().parents[2] / ".cache" /
                               "qwen3-tokenizer"))
    if not (path / "tokenizer.json").is_file():
        raise SystemExit(f"the embed suite needs the real Qwen3 tokenizer in {path}: run "
                         f"tools/fetch_qwen3_tokenizer.sh or set NPQWEN_QWEN3_TOKENIZER")
    return path


def results(report) -> dict:
    return report.get("serving", {}).get("embed", {})


def figures(report) -> dict:
    r, f = results(report), {}
    ours = r.get("npqwen")
    for peer in ("hf-float32", "hf-bfloat16"):
        if ours and peer in r:
            f[f"embed_vs_{peer}"] = r[peer]["seconds"] / ours["seconds"]
    if "hf-float32" in r:
        st = r["hf-float32"]
        f["embed_padded_share"] = 100 * (1 - st["tokens"] / st["padded_tokens"])
        f["embed_st_unpadded_over_padded"] = st["seconds"] / st["unpadded_seconds"]
    return f


def rows(report) -> list:
    return []


def tables(report) -> list:
    r = results(report)
    if not r:
        return []
    names = [COLUMNS[e] for e in r] + (["ST float32, 1 per batch"] if "unpadded_seconds" in r.get("hf-float32", {})
                                       else [])
    runs = list(r.values()) + ([{**r["hf-float32"], "seconds": r["hf-float32"]["unpadded_seconds"],
                                 "padded_tokens": r["hf-float32"]["tokens"]}] if len(names) > len(r) else [])
    body = [("texts/s", [f"{x['texts'] / x['seconds']:.2f}" for x in runs]),
            ("tokens/s", [f"{x['tokens'] / x['seconds']:.1f}" for x in runs]),
            ("seconds for all texts", [f"{x['seconds']:.1f}" for x in runs]),
            ("positions computed / tokens", [f"{x.get('padded_tokens', x['tokens']) / x['tokens']:.2f}"
                                             for x in runs]),
            ("load (s)", [f"{x['load_s']:.2f}" for x in runs]),
            ("peak RSS (GB)", [f"{x['peak_rss_bytes'] / 1e9:.2f}" for x in runs])]
    return [(names, body)]


def notes(report) -> list[str]:
    r, f = results(report), report["figures"]
    if not r:
        return []
    any_run = next(iter(r.values()))
    lines = [f"Embed: {any_run['texts']} texts of {any_run['shortest']}-{any_run['longest']} tokens, "
             f"{any_run['tokens']} in all, {any_run['dims']} dimensions ({any_run['checkpoint']})."]
    if "npqwen" in r and "hf-float32" in r:
        diff = max(abs(a - b) for a, b in zip(r["npqwen"]["first"], r["hf-float32"]["first"]))
        lines.append(f"The first text's first values agree with sentence-transformers float32 to {diff:.1e}.")
    if "embed_padded_share" in f:
        lines.append(f"sentence-transformers' default batching pads {f['embed_padded_share']:.0f}% of the positions "
                     f"it computes; one text per batch (no padding) takes "
                     f"{1 / f['embed_st_unpadded_over_padded']:.2f}x its batched time.")
    return lines
