"""The same calls in one process, or on every rank of `mpiexec -n N` (tensor parallel); what each rank got.

    python tests/parallel_probe.py MODEL OUT [--tp] [--lengths 1,2,300] [--heavy] [--weights FORMAT]

Writes OUT.rank<r>.npz (one process: OUT.rank0.npz) for tests/test_parallel.py to compare: greedy
tokens first, then this process's peak RSS (weights + KV pages: nothing large has been computed
yet), then the logits of every position of a prompt of each length. Unless --heavy (the exact
Qwen3-0.6B shape, where only those are checked): a seeded sampled run, a batched engine run that
reads prompts in chunks over small pages and preempts, a stream, a forward over an explicit cache
(prefill then one token), speculative decoding (prompt lookup), the attention probabilities a recorder sees (and
a hybrid model's out_proj), embeddings and two tokens' scores (prefill-only requests), and an error.
"""
import argparse
import json
import sys

import numpy as np

import npqwen
from npqwen.engine import Engine
from npqwen.generate import decode_one_token, prefill
from npqwen.trace import Trace


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM: ru_maxrss would count the parent's, kept across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed + n).integers(0, vocab, n).tolist()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--tp", action="store_true")
    p.add_argument("--lengths", default="1,2,17,300")
    p.add_argument("--heavy", action="store_true")
    p.add_argument("--weights", default="auto")
    args = p.parse_args()
    llm = npqwen.load(args.model, tensor_parallel=args.tp, weights=args.weights)
    V, out = llm.config.vocab_size, {}
    out["greedy"] = llm.generate(prompt(12, V), max_new_tokens=16, temperature=0).token_ids
    out["peak_rss"] = peak_rss()
    for n in map(int, args.lengths.split(",")):
        out[f"logits_{n}"] = llm.forward(prompt(n, V))
    if not args.heavy:
        probe_more(llm, V, out)
    out["shapes"] = json.dumps({k: list(v.shape) for k, v in llm.weights.items()})
    np.savez(f"{args.out}.rank{llm.comm.rank}.npz", **{k: np.asarray(v) for k, v in out.items()})


def probe_more(llm, V, out):
    out["sampled"] = llm.generate(prompt(9, V), max_new_tokens=24, temperature=0.9, top_k=50, seed=7).token_ids
    engine = Engine(llm, kv_cache_tokens=96, page_size=8, max_batch_size=4, max_batched_tokens=24)
    ids = [engine.add_request(prompt(n, V, seed=1), max_new_tokens=m, temperature=t, seed=3)
           for n, m, t in ((5, 30, 0), (40, 12, 0), (17, 20, 0.8), (1, 25, 0))]
    done, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.result.token_ids
        steps += 1
    out["engine"] = np.concatenate([done[i] for i in ids])
    out["engine_lengths"] = [len(done[i]) for i in ids]
    out["engine_stats"] = json.dumps({"steps": steps, **engine.stats})
    speculative(llm, V, out)
    out["stream"] = json.dumps([len(piece) for piece in llm.stream(prompt(7, V), max_new_tokens=8, temperature=0)])
    cache = llm.new_cache(64)
    first = prefill(llm.model, prompt(30, V), cache, chunk=12)
    out["cache_logits"] = np.stack([first, decode_one_token(llm.model, int(first.argmax()), cache)])
    cfg = llm.config   # a recorder in layer 1, or a hybrid model's first full-attention layer and layer 0
    full = next(i for i in range(1, cfg.num_hidden_layers) if not cfg.is_linear_layer(i))
    trace = Trace(layers=[0, full] if cfg.hybrid else [full])
    llm.forward(prompt(6, V), recorder=trace)
    out["attn_probs"] = trace[f"model.layers.{full}.self_attn.attn_probs"]
    out["o_proj"] = trace[f"model.layers.{full}.self_attn.o_proj"]
    if cfg.hybrid:
        out["out_proj"] = trace["model.layers.0.linear_attn.out_proj"]
        prefix_hits(llm, V, out)
    out["embed"] = llm.embed([prompt(n, V, seed=2) for n in (1, 9, 40)])   # prefill-only requests: pooled states
    scoring = [engine.new_scoring_request(prompt(n, V, seed=4), [3, V - 1]) for n in (6, 30)]
    out["scores"] = np.stack([o.scores for o in llm.run_prefill_only(scoring, engine)])   # lm_head rows of two ranks
    try:
        llm.generate(prompt(5, V), max_new_tokens=0)
        out["error"] = ""
    except npqwen.NpqwenError as e:
        out["error"] = str(e)


def speculative(llm, V, out):
    """Prompt lookup (ngram) drafts, greedy on a prompt of every token of the vocabulary once, as far as the context
    leaves room (so nearly every step's last token occurred before: drafts whatever the random model says, and
    refused ones), and seeded on a prompt that repeats, beside one that does not speculate: each verification a
    chunk of the batch, refused drafts rolled back (a hybrid model's states on every rank)."""
    every = np.random.default_rng(8).permutation(V)[:llm.config.max_position_embeddings - 40].tolist()
    engine = Engine(llm, kv_cache_tokens=len(every) + 160, page_size=8, max_batch_size=3)
    spec = {"method": "ngram", "k": 3, "prompt_lookup_max": 2}
    ids = [engine.add_request(every, max_new_tokens=20, temperature=0, speculative=spec),
           engine.add_request(prompt(4, V, seed=9) * 3, max_new_tokens=20, temperature=0.8, seed=5, speculative=spec),
           engine.add_request(prompt(7, V, seed=10), max_new_tokens=12, temperature=0)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.result.token_ids for o in engine.step() if o.finished})
    out["speculative"] = np.concatenate([done[i] for i in ids])
    out["speculative_stats"] = json.dumps({k: v for k, v in engine.stats.items() if k.startswith("spec_decode_")})


def prefix_hits(llm, V, out):
    """Requests that share a 40-token prefix, one after another: the later ones start from the first's pages
    and, in a hybrid model, from the snapshot of its states at the prefix's end (rank 0's copies, made on
    every rank)."""
    engine = Engine(llm, kv_cache_tokens=160, page_size=8, max_batch_size=2, max_batched_tokens=64)
    shared, tokens = prompt(40, V, seed=5), []
    for n in (3, 7, 5):
        request = engine.add_request(shared + prompt(n, V, seed=6), max_new_tokens=6, temperature=0)
        while engine.has_unfinished():
            tokens += [o.result.token_ids for o in engine.step() if o.finished and o.request_id == request]
    out["prefix_hits"] = np.concatenate(tokens)
    out["prefix_hit_stats"] = json.dumps(engine.stats)


if __name__ == "__main__":
    sys.exit(main())
