"""npqwen vs HF transformers, side by side in one run, on the same checkpoint and prompts.

    python -m tools.bench                       # Qwen3-0.6B shape, random weights (built and cached)
    python -m tools.bench --model DIR --json    # any checkpoint; machine-readable output
    python -m tools.bench --markdown            # the table for docs/speed.md

(run from the repository root.) Each engine (npqwen, HF float32, HF bfloat16) runs in its own
worker process, so load time and peak RSS are its own; the machine's streaming bandwidth
(sampled every 8 decode steps, with a BLAS read of lm_head.weight) and float32 matmul throughput
are measured on the spot, and the figures are reported as ratios, which survive a noisy machine
better than absolute times. Prompts are random token ids; decoding is greedy with a KV cache; a
decode figure is 1 / the median step time; a prefill figure is the best of --repeats runs; with
--rounds the engines take turns and each figure's best round counts.

Suites (--suites, comma-separated, or all; the default is prefill,decode):
    decode    decode tokens/s after each --decode-prompts prompt, one sequence (prefill/decode_one_token)
    batch1    the same decode as a batch of one through npqwen.Engine (the step time of its one
              running request), as a % of the decode figure; implies decode
    prefill   prefill tokens/s of each --prefill prompt, one sequence
    serving   --serving-requests (64) requests arriving at once: random prompt ids, prompt lengths
              and max_new_tokens uniform in --serving-prompt-lens / --serving-output-lens, eos
              ignored, fixed seed. npqwen's engine runs all of them; the baselines (npqwen one
              request after another; HF float32 and bfloat16 in static, left-padded batches of
              --serving-batch, each batch running to its longest request) run only the first
              --serving-sample (16) requests and report rates from that sample, since they are
              the slow part of the run (their total and time to first token cover only those
              requests). Also: the workload's linear-layer FLOPs over the measured float32
              matmul rate (a bound on the engine's time), and peak RSS against the weights plus
              the engine's KV pool (--serving-kv-tokens).
    prefix    --prefix-requests (16) requests sharing a --prefix-tokens (1024) system prompt plus
              32 tokens of their own, run one at a time: time to first token cold vs cached.
    step      the many-token steps: a --step-prefill (1024) token prefill (chunks of 512), and one
              decode step of --step-batch (32) sequences with --step-context (512) cached positions
              each (npqwen: one engine Batch over a filled paged KV cache; HF: a batched forward
              with a DynamicCache). For npqwen, beside each: its linear layers alone at the same
              shapes (ops.linear on the model's own weights), and their share of the step.
              --profile prints a cProfile table of npqwen's two steps to stderr.
    tp        tensor parallelism: --tp-size (2) ranks of 1 BLAS thread (mpiexec) against one process of
              --tp-size threads: decode tokens/s after a 16-token prompt, a --tp-prefill (1024) token
              prefill, each rank's time in collectives and peak RSS (npqwen only; needs mpi4py).

    moe       Qwen3-MoE at the Qwen3-30B-A3B layer shape (2 layers, its own checkpoint: run it alone): a
              --moe-prefill (512) token step and a decode step of --moe-batch (32) requests, npqwen's
              beside its expert products alone and all its matrix products alone; HF with its default
              experts implementation and its eager loop.
    hybrid    Qwen3.5 at the Qwen3.5-0.8B text shape (its own checkpoint: run it alone): decode tokens/s after
              a 16 and a 4,096-token prompt (--hybrid-prompts), prefill tokens/s of --hybrid-prefill (1024).
    structured
              what a constraint's mask costs (npqwen): per token, for a small, a medium and a large
              JSON schema, llguidance filling the next-token mask and consuming the token (mean,
              p99), walked along a valid answer; and one decode step of --structured-batch (16)
              requests through npqwen.Engine with every request constrained vs none (target: at
              most 5% more). A checkpoint without a tokenizer uses --structured-tokenizer's.
    embed     --embed-texts (64) texts of --embed-lens (16-512) tokens at the Qwen3-Embedding-0.6B shape:
              npqwen's llm.embed (packed, no padding) against sentence-transformers' encode in
              float32 and bfloat16 with its default batching (sorted, batches of 32 padded to their
              longest text), and float32 one text at a time (no padding): texts/s, tokens/s, and
              the share of the positions its batching pads. Its workers load a checkpoint of their
              own (--embed-model, default a random one of that shape, built once; needs the real
              Qwen3 tokenizer in .cache/qwen3-tokenizer).
    lora      what LoRA adapters cost (npqwen): a batch-1 decode step through one adapter of rank --lora-rank (16)
              on all seven projections vs none, and a decode step of --lora-batch (32) sequences mixing 4
              adapters vs none (targets: at most 15% and 25% more time).
    speculative
              speculative decoding (npqwen, the model's weight format): one sequence's verify step of 1 + k
              tokens vs a 1-token step (k in --spec-ks), and a greedy request with oracle drafts (the model's
              own answer) 100/80/60% right vs without drafts, side by side a step at a time (tok/s).
              `python -m tools.bench.speculative [--shape 0.8b] [--weights float32,bfloat16,int8,q8_0,q4_k]`
              runs it on 4 layers of Qwen3-0.6B's (Qwen3.5-0.8B's) shape with random weights, per format.
    finetune  LoRA training (its own checkpoint: the 0.6B shape with --finetune-layers (4) layers, float32): npqwen's
              train_step against PEFT + torch float32, tokens/s of one --finetune-tokens (256) example per step,
              and each worker's peak RSS (targets: >= 0.8x the tokens/s, less memory).
    weights   compact weights (bfloat16, int8, Q8_0, Q4_0, Q4_K; docs/weights.md) against float32, side by side
              at the Qwen3-0.6B shape: batch-1 decode, a prefill, a batched decode step, as speed ratios; with
              --weights-memory each format's peak RSS after load and after a 1,024-token generation
              (random checkpoints written in each format, its own; run it alone: --suites weights).
              With --engines npqwen,llama.cpp also npqwen's prefill and decode tokens/s over llama.cpp's
              (node-llama-cpp's prebuilt) on the same GGUF files; skipped with the reason where absent.
    scale_out npqwen on Ray Serve (npqwen/ray.py) on a two-node Ray cluster on this machine: conversations of
              several turns through one replica, two routed by prefix, two in round robin: the share of prompt
              tokens from the prefix caches and output tokens/s (target: two by prefix keep >= 80% of one's
              hits; needs the ray extra; run it alone: --suites scale_out --engines npqwen).

    python -m tools.bench --suites batch1,serving,prefix    # the serving benchmark alone
    python -m tools.bench --suites moe                      # the mixture-of-experts steps
    python -m tools.bench --suites embed                    # embeddings against sentence-transformers

decode, batch1, prefill and step share one worker process per engine and round; serving and
prefix run in another worker per engine, once whatever --rounds says, so their peak RSS is their own.
"""
# One module per suite; a new suite is a new module beside these and one entry here. Each holds:
#   NAME, WORKER, NEEDS   its --suites name; "single" (a worker per engine and round, shared with
#                         the other one-sequence suites) or "serving" (a worker per engine, once);
#                         the suites it implies
#   OWN_MODEL (optional)  True: its workers load a checkpoint of their own, and run gets the
#                         engine's name instead of a loaded engine
#   add_arguments(group)  its flags
#   runs_on(engine, args) whether it runs in that engine's worker ("npqwen", "hf-float32", ...)
#   run(engine, args, rng) -> dict
#                         its measurements, in the worker (engine: an engines.NpqwenEngine or
#                         HFEngine, loaded once for every suite of the worker)
#   figures(report) -> dict, TARGETS
#                         the ratios and bounds it derives from the report, and the targets for them
#   rows(report)          its rows in the table of one column per engine: [(label, cells)]
#   tables(report)        tables of its own: [(column names, rows)]
#   notes(report)         sentences printed under the tables
# The order here is the order of the rows, tables, notes and targets, and of the runs in a worker.
from tools.bench import (batch1, decode, embed, finetune, hybrid, lora, moe, prefill, prefix, scale_out, serving,
                         speculative, step, structured, tp, weights)

SUITES = {suite.NAME: suite for suite in (decode, batch1, prefill, serving, prefix, step, moe, hybrid, structured, tp,
                                          embed, lora, speculative, finetune, weights, scale_out)}
