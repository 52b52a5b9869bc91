"""`npqwen rerank`: how relevant each document is to a query (as llm.rerank scores it), best first, as JSON lines."""
import json
import sys
import time

from ..errors import NpqwenError
from .common import add_engine_sizes, checked_text, engine_sizes, load_model, model_options, peak_rss_bytes, write_out
from .embed import read_texts, run_all


def add_parser(commands):
    p = commands.add_parser("rerank", parents=[model_options()],
                            help="score documents against a query (Qwen3-Reranker's yes/no question), best first")
    p.add_argument("--query", "-q", required=True, help="the query (required)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--document", "-d", action="append", help="a document to score (repeatable)")
    source.add_argument("--documents", metavar="FILE",
                        help="documents: one per line (blank lines skipped), or JSONL lines with \"text\" "
                             "('-' reads stdin)")
    p.add_argument("--instruction", help="the task, in the prompt's <Instruct> line (default: the model card's, "
                                         "\"Given a web search query, retrieve relevant passages that answer the "
                                         "query\")")
    p.add_argument("--top-n", type=int, help="print the n best only (default: every document)")
    add_engine_sizes(p.add_argument_group("engine sizes"))
    p.set_defaults(run=cmd_rerank)


def cmd_rerank(args) -> int:
    from ..engine import Engine
    from ..rerank import scoring_requests, yes_probability

    if args.top_n is not None and args.top_n < 1:
        raise NpqwenError(f"--top-n must be at least 1, got {args.top_n}")
    query = checked_text(args.query, "--query")
    documents = [checked_text(d, "--document") for d in args.document] if args.document else \
        read_texts(args.documents)
    llm, load_seconds = load_model(args)
    engine = Engine(llm, **engine_sizes(args))
    requests = scoring_requests(llm, engine, query, documents, args.instruction)
    tokens = [len(r.prompt_ids) for r in requests]
    started = time.perf_counter()
    scores = yes_probability([o.scores for o in run_all(engine, requests, tokens)])
    seconds = time.perf_counter() - started
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:args.top_n]
    write_out("".join(json.dumps({"index": i, "relevance_score": float(scores[i]), "document": documents[i]},
                                 ensure_ascii=False) + "\n" for i in order))
    lines = [f"load: {load_seconds:.2f} s",
             f"documents: {len(documents)}, {sum(tokens)} prompt tokens in {seconds:.2f} s "
             f"({engine.stats['prefix_cache_hit_tokens']} from the prefix cache)",
             f"peak memory: {peak_rss_bytes() / 1e9:.3f} GB"]
    print("==========\n" + "\n".join(lines), file=sys.stderr)
    return 0
