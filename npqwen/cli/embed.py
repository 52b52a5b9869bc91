"""`npqwen embed`: texts -> embeddings (as llm.embed computes them), all run together through one engine,
written as a NumPy .npy array or JSONL; a progress line on stderr for long inputs."""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import NpqwenError
from .common import (add_engine_sizes, check_writable, checked_text, engine_sizes, input_name, jsonl_objects,
                     load_model, model_options, peak_rss_bytes, read_input_file, write_out)
from .progress import Progress

OUTPUT_KINDS = (".npy", ".jsonl")


def add_parser(commands):
    p = commands.add_parser("embed", parents=[model_options()],
                            help="embed texts (Qwen3-Embedding, or any Qwen3's last-token state) into vectors")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a text to embed (repeatable)")
    source.add_argument("--input", "-i", metavar="FILE",
                        help="texts to embed: one per line (blank lines skipped), or JSONL lines with \"text\" "
                             "('-' reads stdin)")
    p.add_argument("--instruction", help="embed the texts as queries: \"Instruct: {instruction}\\nQuery:{text}\", "
                                         "Qwen3-Embedding's form (default: none, as documents are embedded)")
    p.add_argument("--prompt-name", help="put one of the checkpoint's prompts before each text, e.g. query "
                                         "(default: the checkpoint's default prompt, usually none)")
    p.add_argument("--dimensions", type=int, help="keep the first d values, renormalised (default: all)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="unit-length vectors (default: as the checkpoint says; Qwen3-Embedding: yes)")
    p.add_argument("--output", "-o", metavar="OUT.npy|OUT.jsonl",
                   help="write an (n, d) float32 array (.npy) or one JSON line per text (.jsonl) "
                        "(default: JSON lines on stdout)")
    add_engine_sizes(p.add_argument_group("engine sizes"))
    p.set_defaults(run=cmd_embed)


def cmd_embed(args) -> int:
    from ..embed import check_dimensions, embedding_inputs, finish_vectors
    from ..engine import Engine

    # everything the command line alone can show is checked before the (slow) load
    if args.output:
        check_output(args.output)
    if args.dimensions is not None and args.dimensions < 1:
        raise NpqwenError(f"--dimensions must be at least 1, got {args.dimensions}")
    texts = [checked_text(t, "--text") for t in args.text] if args.text else read_texts(args.input)
    llm, load_seconds = load_model(args)
    config = llm.embedding_config
    if config.problem is not None:
        raise NpqwenError(config.problem)
    width = check_dimensions(args.dimensions, llm.config.hidden_size)
    ids = embedding_inputs(llm, texts, args.instruction, args.prompt_name)
    engine = Engine(llm, **engine_sizes(args))
    started = time.perf_counter()
    outs = run_all(engine, [engine.new_embedding_request(x, config.pooling) for x in ids], [len(x) for x in ids])
    seconds = time.perf_counter() - started
    vectors = finish_vectors(config, np.stack([o.embedding for o in outs]), width, args.normalize)
    write_vectors(vectors, texts, ids, args.output)
    tokens = sum(len(x) for x in ids)
    lines = [f"load: {load_seconds:.2f} s",
             f"texts: {len(texts)}, {tokens} tokens in {seconds:.2f} s, {len(texts) / seconds:.1f} texts/s, "
             f"{tokens / seconds:.1f} tokens/s ({engine.stats['prefix_cache_hit_tokens']} from the prefix cache)",
             f"embeddings: {vectors.shape[0]} x {vectors.shape[1]} float32"
             + (", unit length" if (config.normalize if args.normalize is None else args.normalize) else ""),
             f"peak memory: {peak_rss_bytes() / 1e9:.3f} GB"]
    print("==========\n" + "\n".join(lines), file=sys.stderr)
    if args.output:
        print(f"wrote {len(texts)} embeddings to {args.output}", file=sys.stderr)
    return 0


def run_all(engine, requests: list, tokens: list[int]) -> list:
    """Every prefill-only request through the engine, with the progress line; final outputs in order."""
    index = {r.request_id: i for i, r in enumerate(requests)}
    for r in requests:
        engine.add(r)
    outs = [None] * len(requests)
    with Progress(len(requests), work=sum(tokens)) as progress:
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[index[o.request_id]] = o
                    progress.advance(tokens[index[o.request_id]])
                    progress.finish_one()
            progress.show()
    return outs


def check_output(path: str):
    if Path(path).suffix not in OUTPUT_KINDS:
        raise NpqwenError(f"{path}: --output must end in .npy (an array) or .jsonl (one JSON line per text)")
    check_writable(path, "--output")


def read_texts(path: str) -> list[str]:
    """The texts of FILE: JSONL ("text" fields) if its first non-blank line is a JSON object, else one per line."""
    name, text = input_name(path), read_input_file(path)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise NpqwenError(f"{name}: no texts (every line is blank)")
    objects = jsonl_objects(name, lines)
    if objects is not None:
        texts = []
        for (n, _), o in zip(lines, objects):
            if set(o) != {"text"} or not isinstance(o["text"], str):
                raise NpqwenError(f"{name} line {n}: a JSONL line is {{\"text\": \"...\"}}, got {json.dumps(o)[:60]}")
            texts.append(checked_text(o["text"], f"text on line {n}"))
        return texts
    return [line for _, line in lines]


def write_vectors(vectors: np.ndarray, texts: list[str], ids: list[list[int]], output: str | None):
    if output is not None and output.endswith(".npy"):
        try:
            np.save(output, vectors)
        except OSError as e:
            raise NpqwenError(f"{output}: cannot write it ({e.strerror or e})") from None
        return
    lines = "".join(json.dumps({"index": i, "text": t, "tokens": len(x), "embedding": v.tolist()},
                               ensure_ascii=False) + "\n" for i, (t, x, v) in enumerate(zip(texts, ids, vectors)))
    if output is None:
        return write_out(lines)
    try:
        Path(output).write_text(lines, encoding="utf-8")
    except OSError as e:
        raise NpqwenError(f"{output}: cannot write it ({e.strerror or e})") from None
