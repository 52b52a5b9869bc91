"""scale_out: npqwen on Ray Serve (npqwen/ray.py, docs/scale-out.md), on a Ray cluster of two one-CPU nodes
on this machine. --scale-conversations (8) chat conversations of --scale-turns (4) turns each, run at once
(each conversation's turns one after another, its answer added to the next turn), each with a system prompt
of its own of about --scale-system-tokens (400) tokens; served by one replica, by two replicas routed by
prefix (Ray's PrefixCacheAffinityRouter) and by two replicas in round robin. For each: the share of the
prompt tokens the replicas' prefix caches served (usage.prompt_tokens_details.cached_tokens) and output
tokens/s. Target: two replicas routed by prefix keep at least 80% of the prefix-cache hits one replica gets.
Its model: the Qwen3-0.6B shape with --scale-layers (4) layers, float32 random weights, with the real Qwen3
tokenizer (.cache/qwen3-tokenizer); each replica one BLAS thread on its one CPU."""
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools.bench.engines import CACHE_DIR, random_weights

NAME, WORKER, NEEDS = "scale_out", "single", ()
OWN_MODEL = True
SETUPS = (("one replica", 1, "prefix"), ("two, by prefix", 2, "prefix"), ("two, round robin", 2, "round_robin"))
TARGETS = [("scale_out_prefix_hits_vs_one", ">=", 0.8,
            "scale_out: prefix-cache hits of two replicas routed by prefix vs one replica")]
TOKENIZER = Path(__file__).resolve().parents[2] / ".cache" / "qwen3-tokenizer"


def add_arguments(p):
    p.add_argument("--scale-conversations", type=int, default=8, help="scale_out: conversations at once")
    p.add_argument("--scale-turns", type=int, default=4, help="scale_out: turns of each conversation")
    p.add_argument("--scale-system-tokens", type=int, default=400, help="scale_out: each system prompt's length")
    p.add_argument("--scale-layers", type=int, default=4, help="scale_out: layers of the 0.6B-shaped model")


def runs_on(engine, args) -> bool:
    return engine == "npqwen"


def checkpoint(layers: int) -> Path:
    """The Qwen3-0.6B shape with `layers` layers, float32, random, with the real Qwen3 tokenizer; written once."""
    from npqwen.checkpoint import save_safetensors
    from npqwen.config import QWEN3_0_6B_CONFIG

    path = CACHE_DIR / f"qwen3-0.6b-{layers}-layers-chat"
    if (path / "model.safetensors").is_file():
        return path
    if not (TOKENIZER / "tokenizer.json").is_file():
        raise SystemExit("scale_out needs the Qwen3 tokenizer: tools/fetch_qwen3_tokenizer.sh")
    print(f"[bench] building {path} (once)", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(QWEN3_0_6B_CONFIG, num_hidden_layers=layers, max_window_layers=layers)
    save_safetensors(path / "model.safetensors.tmp", random_weights(config), "F32")
    for f in TOKENIZER.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "model.safetensors.tmp").rename(path / "model.safetensors")
    return path


def conversations(args) -> list[str]:
    """Each conversation's system prompt: words of its own, about --scale-system-tokens tokens."""
    import numpy as np

    rng = np.random.default_rng(7)
    words = ["river", "stone", "garden", "engine", "violet", "harbor", "lantern", "meadow", "copper", "window",
             "orbit", "thistle", "canyon", "saddle", "marble", "falcon"]
    return [f"You are assistant number {c}. " + " ".join(rng.choice(words, args.scale_system_tokens).tolist())
            for c in range(args.scale_conversations)]


def workload(url: str, args) -> dict:
    """Every conversation at once, its turns in order: (prompt tokens, cached tokens, output tokens, seconds)."""
    import urllib.error
    import urllib.request

    def talk(system: str) -> list:
        messages, counts = [{"role": "system", "content": system}], []
        for turn in range(args.scale_turns):
            messages.append({"role": "user", "content": f"Question {turn}: say something about {system[-40:]}"})
            body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as e:
                raise SystemExit(f"scale_out: HTTP {e.code} from the Ray app: {e.read()[:500]!r}") from None
            usage = answer["usage"]
            counts.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                           usage["completion_tokens"]))
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        return counts

    started = time.perf_counter()
    with ThreadPoolExecutor(args.scale_conversations) as pool:
        counts = [c for talk_counts in pool.map(talk, conversations(args)) for c in talk_counts]
    seconds = time.perf_counter() - started
    prompt, cached, output = (sum(c[i] for c in counts) for i in range(3))
    return {"prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output, "seconds": seconds,
            "cached_share": cached / prompt, "output_tps": output / seconds}


def run(engine, args, rng) -> dict:
    import socket

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from npqwen.ray import build_app

    model = checkpoint(args.scale_layers)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="error", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "ERROR"})
    out = {}
    try:
        for i, (label, replicas, router) in enumerate(SETUPS):
            print(f"[bench] scale_out: {label} ...", file=sys.stderr, flush=True)
            # an app name of its own each time: a router's prefix tree (a detached actor named after the app)
            # is killed with its app, and a new app of the same name would find the dead one
            serve.run(build_app({"model": str(model), "served_model_name": "m", "num_replicas": replicas,
                                 "router": router, "ray_actor_options": {
                                     "num_cpus": 1, "runtime_env": {"env_vars": {"OPENBLAS_NUM_THREADS": "1"}}}}),
                      name=f"npqwen-{i}", route_prefix="/")
            out[label] = workload(f"http://127.0.0.1:{port}", args)
            serve.delete(f"npqwen-{i}")
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return {"scale_out": {"setups": out, "conversations": args.scale_conversations, "turns": args.scale_turns,
                          "system_tokens": args.scale_system_tokens, "layers": args.scale_layers}}


def figures(report) -> dict:
    s = report.get("engines", {}).get("npqwen", {}).get("scale_out")
    if not s:
        return {}
    one, prefix, rr = (s["setups"][label] for label, _, _ in SETUPS)
    return {"scale_out_prefix_hits_vs_one": prefix["cached_share"] / one["cached_share"],
            "scale_out_round_robin_hits_vs_one": rr["cached_share"] / one["cached_share"],
            "scale_out_two_vs_one_tps": prefix["output_tps"] / one["output_tps"]}


def rows(report) -> list:
    return []


def tables(report) -> list:
    s = report.get("engines", {}).get("npqwen", {}).get("scale_out")
    if not s:
        return []
    return [(["prompt tokens", "from the cache", "output tok/s", "seconds"],
             [(f"scale_out: {label}", [str(r["prompt_tokens"]), f"{r['cached_share']:.0%}", f"{r['output_tps']:.1f}",
                                       f"{r['seconds']:.1f}"]) for label, r in s["setups"].items()])]


def notes(report) -> list[str]:
    f = report["figures"]
    if "scale_out_prefix_hits_vs_one" not in f:
        return []
    s = report["engines"]["npqwen"]["scale_out"]
    return [f"Scale-out on Ray Serve: {s['conversations']} conversations of {s['turns']} turns at once, a system "
            f"prompt of about {s['system_tokens']} tokens each ({s['layers']} layers of the 0.6B shape): two "
            f"replicas routed by prefix keep {f['scale_out_prefix_hits_vs_one']:.0%} of one replica's prefix-cache "
            f"hits, round robin {f['scale_out_round_robin_hits_vs_one']:.0%}; two replicas serve "
            f"{f['scale_out_two_vs_one_tps']:.2f}x one replica's output tokens/s."]
