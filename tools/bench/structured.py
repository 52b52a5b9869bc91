"""structured: what a constraint's mask costs. Per token, for a small, a medium and a large JSON
schema: llguidance filling the next-token mask (in the engine's worker thread, beside the forward
pass) and consuming the drawn token, walked along a valid answer. And one decode step of
--structured-batch (16) requests through npqwen.Engine, every request constrained vs none (the
median of --structured-steps (16) steps each, taken in turn), with how long the step waited for its
masks."""
import json
import os
import time
from pathlib import Path

NAME, WORKER, NEEDS = "structured", "single", ()
ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = Path(os.environ.get("NPQWEN_QWEN3_TOKENIZER", ROOT / ".cache" / "qwen3-tokenizer"))
TARGETS = [("structured_step_overhead_pct", "<=", 5,
            "decode step, every request constrained vs none: % more time")]
ROWS = {"structured_step_free_s": "decode step, free requests (s)",
        "structured_step_constrained_s": "decode step, constrained requests (s)",
        "structured_mask_wait_s": "  of which waiting for the masks (s)"}


def obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


TEXT = {"type": "string", "maxLength": 40}
ADDRESS = obj({"street": TEXT, "city": TEXT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
               "country": {"enum": ["FR", "DE", "IT", "ES", "GB", "US"]}})
SCHEMAS = {   # name -> (schema, a valid answer to walk)
    "small": (obj({"name": TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
              {"name": "Ada Lovelace", "age": 36}),
    "medium": (obj({"id": {"type": "string", "format": "uuid"}, "title": TEXT,
                    "tags": {"type": "array", "items": TEXT, "maxItems": 5},
                    "rating": {"type": "number", "minimum": 0, "maximum": 5},
                    "status": {"enum": ["draft", "published", "archived"]},
                    "author": obj({"name": TEXT, "email": {"type": "string", "format": "email"}}),
                    "created": {"type": "string", "format": "date"}}),
               {"id": "3f2b8c1e-9a4d-4e7b-8c2a-1d5e6f7a8b9c", "title": "Structured output",
                "tags": ["json", "grammar", "llguidance"], "rating": 4.5, "status": "published",
                "author": {"name": "Grace Hopper", "email": "grace@example.com"}, "created": "2025-06-01"}),
    "large": ({"$defs": {"address": ADDRESS,
                         "person": obj({"name": TEXT, "born": {"type": "string", "format": "date"},
                                        "address": {"$ref": "#/$defs/address"},
                                        "phone": {"anyOf": [{"type": "string", "pattern": "^\\+[0-9]{6,12}$"},
                                                            {"type": "null"}]}})},
               **obj({"company": TEXT, "founded": {"type": "integer", "minimum": 1800, "maximum": 2030},
                      "headquarters": {"$ref": "#/$defs/address"},
                      "people": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1,
                                 "maxItems": 20},
                      "products": {"type": "array", "maxItems": 20, "items": obj({
                          "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "name": TEXT,
                          "price": {"type": "number", "minimum": 0}, "in_stock": {"type": "boolean"},
                          "kind": {"enum": ["hardware", "software", "service"]}})},
                      **{f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 10 ** i} for i in range(20)}})},
              {"company": "Analytical Engines Ltd", "founded": 1843,
               "headquarters": {"street": "12 Baker Street", "city": "London", "zip": "10001", "country": "GB"},
               "people": [{"name": "Ada Lovelace", "born": "1815-12-10", "address": {
                   "street": "1 St James's Square", "city": "London", "zip": "20002", "country": "GB"},
                   "phone": None}, {"name": "Charles Babbage", "born": "1791-12-26", "address": {
                       "street": "1 Dorset Street", "city": "London", "zip": "30003", "country": "GB"},
                       "phone": "+4420700000"}],
               "products": [{"sku": "DIF-0001", "name": "Difference Engine", "price": 17000.0, "in_stock": False,
                             "kind": "hardware"},
                            {"sku": "ANA-0002", "name": "Analytical Engine", "price": 0, "in_stock": True,
                             "kind": "hardware"}],
               **{f"field_{i}": i for i in range(20)}}),
}


def add_arguments(p):
    p.add_argument("--structured-batch", type=int, default=16, help="structured: requests in the decode step")
    p.add_argument("--structured-steps", type=int, default=16, help="structured: decode steps timed, each way")
    p.add_argument("--structured-tokenizer", default=str(TOKENIZER_DIR),
                   help="structured: tokenizer.json's folder when the checkpoint has none (default: the real "
                        "Qwen3 one, tools/fetch_qwen3_tokenizer.sh)")


def runs_on(engine, args) -> bool:
    return engine == "npqwen"


def run(engine, args, rng) -> dict:
    """The masks' cost per token for each schema, and the decode step with and without constraints."""
    llm = engine.llm
    if llm.tokenizer is None:   # the default random checkpoint has no tokenizer: Qwen3's own
        from npqwen.tokenizer import Tokenizer
        llm.tokenizer = Tokenizer.from_dir(args.structured_tokenizer)
    from npqwen.structured import ll_tokenizer

    ll_tokenizer(llm.tokenizer, llm.config.vocab_size, llm.eos_token_ids)   # made once (~1 s), not timed
    out = {"structured_masks": {name: mask_costs(llm, schema, answer) for name, (schema, answer) in SCHEMAS.items()}}
    out.update(decode_steps(llm, args))
    return out


def mask_costs(llm, schema, answer) -> dict:
    """Walk a valid answer's tokens through a fresh constraint: per token, the worker's fill of the
    mask (as Masks.fill does it, for one request) and the consume of the token; mean and p99 in ms."""
    import numpy as np

    from npqwen.structured import Masks, new_constraint

    started = time.perf_counter()
    constraint = new_constraint(llm.tokenizer, llm.config.vocab_size, llm.eos_token_ids, json_schema=schema)
    compile_s = time.perf_counter() - started
    masks = Masks(llm.config.vocab_size)
    masks.start([constraint])               # makes the executor and the worker thread; not timed
    masks.wait()
    tokens = llm.tokenizer.encode(json.dumps(answer))
    fills, consumes = [], []
    for position, token in enumerate(tokens):
        started = time.perf_counter()
        allowed = masks.fill([constraint.matcher])[0]
        fills.append(time.perf_counter() - started)
        assert allowed[token], f"token {position} of the answer is not allowed: the answer does not fit its schema"
        started = time.perf_counter()
        constraint.advance(token, position)
        consumes.append(time.perf_counter() - started)
    ms = lambda xs: (1e3 * float(np.mean(xs)), 1e3 * float(np.percentile(xs, 99)))   # noqa: E731
    (fill_mean, fill_p99), (consume_mean, consume_p99) = ms(fills), ms(consumes)
    return {"tokens": len(tokens), "schema_bytes": len(json.dumps(schema)), "compile_ms": 1e3 * compile_s,
            "fill_mean_ms": fill_mean, "fill_p99_ms": fill_p99, "consume_mean_ms": consume_mean,
            "consume_p99_ms": consume_p99}


def decode_steps(llm, args) -> dict:
    """--structured-batch requests of 32 random prompt tokens, sampled at temperature 1 with top-k 20
    (seeded, eos cleared so none ends early), in two engines: every request free in one, every one
    constrained by the medium schema in the other. Their decode steps alternate, one of each in
    turn, so that the load of a shared machine falls on both alike; the median of
    --structured-steps steps of each, and how long a constrained step waited for its masks."""
    import numpy as np

    from npqwen import Engine
    from npqwen.structured import Masks

    B, steps = args.structured_batch, args.structured_steps
    prompts = np.random.default_rng(2).integers(0, llm.config.vocab_size, (B, 32)).tolist()
    schema = SCHEMAS["medium"][0]

    def engine(constrained: bool):
        made = Engine(llm, kv_cache_tokens=B * 64, page_size=64, max_batched_tokens=B * 32)
        for i, ids in enumerate(prompts):
            rid = made.add_request(ids, max_new_tokens=steps + 2, temperature=1.0, top_k=20, seed=i,
                                   **({"json_schema": schema} if constrained else {}))
            made.requests[rid].eos_ids = frozenset()
        made.step()                                     # the prefill (and each request's first token)
        return made

    free, constrained = engine(False), engine(True)
    assert all(r.constraint is not None for r in constrained.requests.values())
    waited, wait = [], Masks.wait

    def timed_wait(self):
        started = time.perf_counter()
        wait(self)
        waited.append(time.perf_counter() - started)

    times = {False: [], True: []}
    for _ in range(steps):
        for which, e in ((False, free), (True, constrained)):
            Masks.wait = timed_wait if which else wait
            started = time.perf_counter()
            outputs = e.step()
            times[which].append(time.perf_counter() - started)
            assert len(outputs) == B                    # every request decoded in the one step
    Masks.wait = wait
    median = lambda xs: sorted(xs)[len(xs) // 2]         # noqa: E731
    return {"structured_batch": B, "structured_step_free_s": median(times[False]),
            "structured_step_constrained_s": median(times[True]),
            "structured_mask_wait_s": median(waited) if waited else 0.0}


def figures(report) -> dict:
    e = report["engines"].get("npqwen", {})
    if "structured_step_free_s" not in e:
        return {}
    return {"structured_step_overhead_pct":
            100 * (e["structured_step_constrained_s"] / e["structured_step_free_s"] - 1)}


def rows(report) -> list:
    from tools.bench.tables import row

    return [row(report, key, label, "{:.4f}") for key, label in ROWS.items()
            if any(key in figures for figures in report["engines"].values())]


def tables(report) -> list:
    masks = report["engines"].get("npqwen", {}).get("structured_masks")
    if not masks:
        return []
    body = [(name, [str(m["tokens"]), str(m["schema_bytes"]), f"{m['compile_ms']:.1f}", f"{m['fill_mean_ms']:.3f}",
                    f"{m['fill_p99_ms']:.3f}", f"{m['consume_mean_ms']:.3f}"]) for name, m in masks.items()]
    return [(["answer tokens", "schema bytes", "compile (ms)", "mask mean (ms)", "mask p99 (ms)",
              "consume mean (ms)"], body)]


def notes(report) -> list[str]:
    e = report["engines"].get("npqwen", {})
    if "structured_step_free_s" not in e:
        return []
    return [f"Structured output: a decode step of {e['structured_batch']} requests takes "
            f"{e['structured_step_constrained_s']:.4f} s with every request constrained by the medium schema, "
            f"{e['structured_step_free_s']:.4f} s with none "
            f"({report['figures']['structured_step_overhead_pct']:+.1f}%); the step waited "
            f"{e['structured_mask_wait_s']:.4f} s (median) for its masks, which the worker thread fills while the "
            f"forward pass runs."]
