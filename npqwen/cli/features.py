"""`npqwen features`: each token of a prompt and the SAE or transcoder features strongest on it (npqwen/features.py),
with the reconstruction's relative error per token."""
import numpy as np

from ..errors import NpqwenError
from ..features import load_labels, load_sae
from .common import checked_text, load_model, model_options, one_prompt_options, prompt_ids, write_out
from .lens import token_text


def add_parser(commands):
    p = commands.add_parser("features", parents=[model_options(), one_prompt_options()],
                            help="the strongest SAE / transcoder features on each token of a prompt")
    p.add_argument("--sae", action="append", required=True, metavar="PATH",
                   help="a Qwen-Scope layer{n}.sae.pt, a SAELens folder (cfg.json) or a circuit-tracer "
                        "layer_{n}.safetensors; repeat for several (required)")
    p.add_argument("--labels", action="append", default=[], metavar="FILE",
                   help="feature descriptions from a Neuronpedia export (a JSON array or JSON lines of "
                        "{index, description}); the first goes with the first --sae, and so on (default: none)")
    p.add_argument("--top-k", type=int, default=5, help="features shown per token (default: 5)")
    p.set_defaults(run=cmd_features)


def cmd_features(args) -> int:
    prompt = checked_text(args.prompt, "prompt")
    if args.top_k < 1:
        raise NpqwenError(f"--top-k must be at least 1, got {args.top_k}")
    if len(args.labels) > len(args.sae):
        raise NpqwenError(f"{len(args.labels)} --labels files for {len(args.sae)} --sae: give at most one per SAE, "
                          f"in the same order")
    labels = [load_labels(path) for path in args.labels]   # read before the (slow) load
    llm, _ = load_model(args, chat_template=args.chat)
    saes = [load_sae(path, llm.config) for path in args.sae]   # checked against the model
    ids = prompt_ids(llm, args, prompt)
    _, runs = llm.run_with_saes(ids, saes, top=args.top_k)
    for j, (path, run) in enumerate(zip(args.sae, runs)):
        write_out(features_table(run, [token_text(llm.tokenizer.decode([i]), 16) for i in ids], path,
                                 labels[j] if j < len(labels) else None))
    return 0


def features_table(run, tokens: list[str], path: str, labels: dict | None = None) -> str:
    """One line per token: its text, the relative error of the reconstruction, and its top features as id:value;
    then, with labels, the description of each feature shown."""
    sae = run.sae
    target = run.error + run.reconstruction                                    # what the SAE reconstructs (T, D)
    rel = np.linalg.norm(run.error, axis=-1) / np.maximum(np.linalg.norm(target, axis=-1), 1e-30)
    lines = [f"{path}: {sae.kind} {sae.architecture}{f' k={sae.k}' if sae.k else ''}, {sae.width} features, "
             f"reads {sae.reads}" + (f", writes {sae.writes}" if sae.kind == "transcoder" else ""),
             f"{'pos':>4}  {'token':<16}  {'error':>6}  top features (id:activation)"]
    for t, token in enumerate(tokens):
        top = "  ".join(f"{i}:{v:.3g}" for i, v in zip(run.indices[t], run.values[t]) if v != 0) or "(none active)"
        lines.append(f"{t:>4}  {token:<16}  {rel[t]:>6.3f}  {top}")
    if labels:
        shown = sorted({int(i) for i, v in zip(run.indices.ravel(), run.values.ravel()) if v != 0})
        lines += [f"{i:>8}  {labels[i]}" for i in shown if i in labels]
    return "\n".join(lines) + "\n"
