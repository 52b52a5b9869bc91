"""What the commands share: the option groups (model, sampling, engine sizes, one prompt), checks
made before the (slow) load, the load itself, writing to stdout, and the closing statistics."""
import argparse
import codecs
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

from ..errors import NpqwenError
from ..hub import DEFAULT_MODEL, missing_files
from ..kv_cache import KV_CACHE_DTYPES
from .parallel import share_load

# Every option's help ends with its default: "(default: ...)", written out where None means
# "the checkpoint's value" or "off".


class OutputError(NpqwenError):
    """stdout cannot take the output (a full disk, /dev/full, a closed terminal)."""


# C0 controls but tab and newline, DEL, C1: a random model's bytes can move the cursor or clear the screen
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """Text as a terminal should show it: each control character written as its escape ("\\x1b")."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def write_out(text: str):
    """Write to stdout and flush (control characters escaped on a terminal, raw into a file or a pipe);
    a failed write (no space left) is one clear error."""
    try:
        sys.stdout.write(shown(text) if sys.stdout.isatty() else text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write the output to stdout ({e.strerror or e})") from None


def model_options() -> argparse.ArgumentParser:
    """--model, --device, --dtype: a parent parser for every command."""
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", "-m", default=DEFAULT_MODEL,
                       help=f"checkpoint directory, hub id in the HF cache (downloaded if missing), or 'tiny' / "
                            f"'tiny-moe' / 'tiny-qwen3.5' / 'tiny-qwen4-exp' / 'tiny-embedding' / 'tiny-reranker' "
                            f"(built-in, random weights) "
                            f"(default: {DEFAULT_MODEL})")
    model.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default: cpu)")
    model.add_argument("--dtype", default="float32",
                       help="compute dtype; cpu: float32, float64; cuda: also float16 (default: float32)")
    model.add_argument("--weights", default="auto", metavar="FORMAT",
                       help="how the weight matrices are kept (docs/weights.md): auto (float32 where it fits and the "
                            "file is not quantized, else as stored), stored, float32, bfloat16, float16, int8, q8_0, "
                            "q4_0, q4_k (default: auto)")
    return model


def lora_options() -> argparse.ArgumentParser:
    """--lora name=path (repeatable): PEFT LoRA adapters loaded beside the model (npqwen/lora.py)."""
    lora = argparse.ArgumentParser(add_help=False)
    lora.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                      help="load the PEFT LoRA adapter in directory PATH under NAME (repeatable; default: none)")
    return lora


def lora_paths(args) -> dict:
    """--lora name=path, ... as {name: path}; a malformed or repeated name is refused."""
    paths = {}
    for item in getattr(args, "lora", None) or []:
        name, eq, path = item.partition("=")
        if not eq or not name.strip() or not path:
            raise NpqwenError(f"--lora takes NAME=PATH (an adapter's name and its directory), got {item!r}")
        if name in paths:
            raise NpqwenError(f"--lora names {name!r} twice")
        paths[name] = path
    return paths


def chosen_lora(args) -> str | None:
    """The adapter a generate or chat command runs through: --lora-name, or the only --lora given."""
    paths = lora_paths(args)
    name = getattr(args, "lora_name", None)
    if name is not None and name not in paths:
        raise NpqwenError(f"--lora-name {name!r} is not one of the adapters given with --lora "
                          f"({', '.join(paths) or 'none'})")
    return name if name is not None else (next(iter(paths)) if len(paths) == 1 else None)


def sampling_options() -> argparse.ArgumentParser:
    """The sampling values, --system and --no-think: a parent parser for the commands that generate."""
    sampling = argparse.ArgumentParser(add_help=False)
    checkpoint = "(default: generation_config.json's, else %s)"
    sampling.add_argument("--max-new-tokens", "-n", type=int, default=512,
                          help="most tokens to generate (default: 512)")
    sampling.add_argument("--temperature", "-t", type=float, help="0 is greedy " + checkpoint % "0")
    sampling.add_argument("--top-k", type=int, help="0 is off " + checkpoint % "0")
    sampling.add_argument("--top-p", type=float, help="1 is off " + checkpoint % "1")
    sampling.add_argument("--min-p", type=float, help="0 is off " + checkpoint % "0")
    sampling.add_argument("--repetition-penalty", type=float, help="1 is off " + checkpoint % "1")
    sampling.add_argument("--presence-penalty", type=float, help="0 is off (default: 0)")
    sampling.add_argument("--frequency-penalty", type=float,
                          help="subtracted once per earlier occurrence of a token, OpenAI's rule; 0 is off (default: 0)")
    sampling.add_argument("--seed", type=int, help="for a reproducible draw (default: none, a fresh draw each run)")
    sampling.add_argument("--stop", action="append",
                          help="stop string (repeatable); not included in the output (default: none)")
    sampling.add_argument("--no-think", action="store_true",
                          help="enable_thinking=False in the chat template (default: thinking on)")
    add_thinking_budget(sampling)
    sampling.add_argument("--speculative", metavar="METHOD[:K]",
                          help="speculative decoding: 'ngram' (prompt lookup) or 'mtp' (Qwen3.5's MTP head), K drafts "
                               "per step (default 4), or vLLM's JSON ({\"method\": \"ngram\", \"k\": 4}); the output "
                               "is the same, only the speed changes (default: off; docs/speculative.md)")
    sampling.add_argument("--system", help="system message (default: none)")
    return sampling


def add_thinking_budget(parser):
    """--thinking-budget N: generate, chat and serve."""
    parser.add_argument("--thinking-budget", type=int, metavar="N",
                        help="with thinking on, end the reasoning after N tokens by writing '\\n</think>\\n\\n' "
                             "for the model (default: none; a constrained answer's reasoning ends at the latest when "
                             "half of its max tokens are spent)")


def one_prompt_options() -> argparse.ArgumentParser:
    """--prompt and --chat: a parent parser for the commands that run one forward pass (trace, compare)."""
    one_pass = argparse.ArgumentParser(add_help=False)
    one_pass.add_argument("--prompt", "-p", required=True, help="the input text (required)")
    one_pass.add_argument("--chat", action="store_true",
                          help="apply the chat template to the prompt first (default: the prompt as is)")
    return one_pass


def steering_options() -> argparse.ArgumentParser:
    """--steer FILE.npy, --steer-layer, --steer-scale: a parent parser for generate and chat (npqwen/steering.py)."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("steering (see docs/interpretability.md)")
    group.add_argument("--steer", metavar="FILE.npy", help="add this vector (D values, np.save'd) to the residual "
                                                           "stream after block --steer-layer (default: none)")
    group.add_argument("--steer-layer", type=int, metavar="L", help="the block the vector is added after "
                                                                    "(required with --steer; no default)")
    group.add_argument("--steer-scale", type=float, default=1.0, metavar="S", help="the vector's scale (default: 1)")
    return options


def command_line_steering(args):
    """The command line's steering list, or None; the file read now, before the (slow) load (its length and
    layer are checked against the model when the request is made)."""
    if args.steer is None:
        if args.steer_layer is not None:
            raise NpqwenError("--steer-layer goes with --steer FILE.npy")
        return None
    if args.steer_layer is None:
        raise NpqwenError("--steer needs --steer-layer L (the block the vector is added after)")
    import numpy as np

    try:
        vector = np.load(args.steer, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise NpqwenError(f"--steer {args.steer}: cannot read it as a .npy array ({e})") from None
    return [{"layer": args.steer_layer, "vector": vector, "scale": args.steer_scale}]


def checked_command_line_steering(steering, llm, args):
    """The command line's steering checked against the loaded model, its mistakes named by their options
    (check_steering names the fields of a request body: steering[0].layer, .vector, .scale)."""
    from ..steering import check_steering

    if steering is None:
        return None
    try:
        return check_steering(steering, llm.config)
    except NpqwenError as e:
        options = {"steering[0].layer": "--steer-layer", "steering[0].vector": f"--steer {args.steer}: the vector",
                   "steering[0].scale": "--steer-scale"}
        message = str(e)
        for field, option in options.items():
            message = message.replace(field, option)
        raise NpqwenError(message) from None


def feature_edit_options() -> argparse.ArgumentParser:
    """--sae PATH with --clamp-feature F=V, --zero-feature F, --scale-feature F=S: a parent parser for generate
    and chat (feature_edits, npqwen/features.py)."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("feature edits (see docs/features.md)")
    group.add_argument("--sae", metavar="PATH", help="the SAE whose features the edits set: a Qwen-Scope "
                                                     "layer{n}.sae.pt or a SAELens folder, on a block's output "
                                                     "(default: none)")
    group.add_argument("--clamp-feature", action="append", default=[], metavar="F=V",
                       help="set feature F's activation to V at every position (repeatable; default: none)")
    group.add_argument("--zero-feature", action="append", default=[], metavar="F", type=int,
                       help="set feature F's activation to 0 (repeatable; default: none)")
    group.add_argument("--scale-feature", action="append", default=[], metavar="F=S",
                       help="multiply feature F's activation by S (repeatable; default: none)")
    return options


def command_line_feature_edits(args) -> list | None:
    """The command line's edits as feature_edits items without their SAE (loaded with the model), or None;
    checked for their form now, before the (slow) load."""
    edits = [{"feature": f, "zero": True} for f in args.zero_feature]
    for option, mode in (("clamp_feature", "clamp"), ("scale_feature", "scale")):
        for text in getattr(args, option):
            feature, _, value = text.partition("=")
            try:
                edits.append({"feature": int(feature), mode: float(value)})
            except ValueError:
                raise NpqwenError(f"--{option.replace('_', '-')} takes FEATURE=VALUE (an integer and a number), "
                                  f"got {text!r}") from None
    if edits and args.sae is None:
        raise NpqwenError("--clamp-feature, --zero-feature and --scale-feature need --sae PATH (the SAE whose "
                          "features they are)")
    if args.sae is not None and not edits:
        raise NpqwenError("--sae needs an edit: --clamp-feature F=V, --zero-feature F or --scale-feature F=S")
    return edits or None


def checked_command_line_feature_edits(edits, llm, args):
    """The edits with their SAE, loaded and checked against the model; mistakes named by their options."""
    from ..features import check_feature_edits, load_sae

    if edits is None:
        return None
    sae = load_sae(args.sae, llm.config)
    try:
        return check_feature_edits([{"sae": sae, **e} for e in edits], llm.config)
    except NpqwenError as e:
        raise NpqwenError(re.sub(r"feature_edits\[\d+\]", "the feature edit", str(e))) from None


def constraint_options() -> argparse.ArgumentParser:
    """--json-schema, --regex, --choice, --grammar (at most one): a parent parser for generate and chat."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("structured output (the answer always matches; see docs/structured-output.md)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE|JSON",
                     help="the answer is JSON valid against this schema: a file, or the schema's JSON text "
                          "(default: none)")
    one.add_argument("--regex", metavar="RE", help="the whole answer matches this regex (default: none)")
    one.add_argument("--choice", metavar="TEXT", action="append",
                     help="the answer is one of these (repeatable) (default: none)")
    one.add_argument("--grammar", metavar="FILE",
                     help="the answer follows this grammar: llguidance's Lark, or GBNF (default: none)")
    return options


CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")   # also JSONL fields of --prompts-file


def constraint_kwargs(args) -> dict:
    """The command line's constraint as SamplingParams' keyword arguments, its files read (the values
    are checked by SamplingParams, the schema, regex or grammar itself when the request is made)."""
    schema, grammar = args.json_schema, args.grammar
    if schema is not None and not schema.lstrip().startswith(("{", "true", "false")):
        schema = read_text_file(schema, "--json-schema", "the schema's JSON text")
    if grammar is not None:
        grammar = read_text_file(grammar, "--grammar", None)
    return {k: v for k, v in zip(CONSTRAINT_FIELDS, (schema, args.regex, args.choice, grammar)) if v is not None}


def input_name(path: str) -> str:
    """How messages name an input file ("-" is stdin)."""
    return "stdin" if path == "-" else path


def read_input_file(path: str) -> str:
    """The text of an input file, or stdin for "-": UTF-8, a byte-order mark dropped; a file that cannot be
    read, or is not UTF-8 (the line of the first bad byte named), is one clear error."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise NpqwenError(f"{input_name(path)}: cannot read it ({e.strerror or e})") from None
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise NpqwenError(f"{input_name(path)} line {line}: not valid UTF-8 (byte {data[e.start]:#04x}); "
                          f"fix the file's encoding") from None


def read_text_file(path: str, option: str, instead: str | None) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NpqwenError(f"{option} {path}: no such file" + (f" (give a file or {instead})" if instead else "")) \
            from None
    except (OSError, UnicodeDecodeError) as e:
        raise NpqwenError(f"{option} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "seed", "stop", "frequency_penalty")
ENGINE_SIZES = ("max_batch_size", "max_batched_tokens", "kv_cache_tokens", "page_size",
                "state_snapshots", "kv_cache_dtype", "prefix_cache_dir", "prefix_cache_dir_size")   # npqwen.Engine's


def add_engine_sizes(group):
    group.add_argument("--max-batch-size", type=int, help="most requests in one step (default: the engine's, 64)")
    group.add_argument("--max-batched-tokens", type=int, help="most tokens in one step (default: the engine's, 512)")
    group.add_argument("--kv-cache-tokens", type=int,
                       help="KV-cache positions (default: the engine's, half the free memory)")
    group.add_argument("--page-size", type=int, help="positions per KV-cache page (default: the engine's, 256)")
    group.add_argument("--state-snapshots", type=int, help="hybrid models (Qwen3.5): linear-attention states kept "
                       "at the end of cached prefixes, for prefix hits (default: the engine's, 16)")
    group.add_argument("--no-prefix-cache", action="store_true", help="do not reuse pages of shared prefixes "
                       "(default: reuse them)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                       help="how keys and values are stored: auto is the compute dtype; bfloat16 halves float32's "
                            "memory, float8_e4m3 and int8 quarter it, widened a page at a time as attention reads "
                            "them (docs/engine.md; default: auto)")
    group.add_argument("--prefix-cache-dir", metavar="DIR",
                       help="keep the KV pages of cached prefixes in files in DIR too, read back after a restart, so "
                            "a long system prompt is computed once per machine (default: in memory only)")
    group.add_argument("--prefix-cache-dir-size", type=float, metavar="GB",
                       help="the most --prefix-cache-dir holds; least recently used pages go first (default: 16)")


def engine_sizes(args) -> dict:
    """npqwen.Engine's keyword arguments given on the command line."""
    sizes = {k: getattr(args, k) for k in ENGINE_SIZES if getattr(args, k) is not None}
    return {**sizes, **({"prefix_cache": False} if args.no_prefix_cache else {})}


def check_device_dtype(args):
    """npqwen.load's device and dtype checks, before anything slow (inspect never calls load)."""
    from ..llm import check_device_dtype as check

    check(args.device, args.dtype)


def check_writable(path: str, option: str):
    """Before the slow work: `path` must be a file name in a folder that exists and can be written."""
    target, folder = Path(path), Path(path).parent
    if target.is_dir():
        raise NpqwenError(f"{path}: cannot write it ({option}): it is a directory; give a file name")
    if not folder.is_dir():
        raise NpqwenError(f"{path}: cannot write it ({option}): no such directory {str(folder)!r}")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise NpqwenError(f"{path}: cannot write it ({option}): permission denied")


def command_line_params(args, thinking: bool):
    """The command line's SamplingParams (the sampling values, the constraint, and whether the answer
    opens with thinking), checked now, before the (slow) load. Values not given are None: the
    checkpoint's, when the engine makes the request."""
    from dataclasses import replace

    from ..sampling_params import SamplingParams

    params = SamplingParams(**sampling_kwargs(args), thinking=thinking)
    constraint = constraint_kwargs(args)
    if not constraint:
        return params
    try:
        return replace(params, **constraint)
    except NpqwenError as e:   # the values are fine but the constraint is not: name its option
        raise NpqwenError(f"--{next(iter(constraint)).replace('_', '-')}: {e}") from None


def sampling_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, seed=args.seed, stop=args.stop,
                frequency_penalty=args.frequency_penalty, thinking_budget=args.thinking_budget,
                speculative=speculative_option(getattr(args, "speculative", None)))


def speculative_option(text: str | None) -> dict | None:
    """--speculative: "ngram", "mtp:2", or a JSON object of vLLM's speculative_config fields."""
    if text is None:
        return None
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise NpqwenError(f"--speculative: not valid JSON ({e})") from None
        return value
    method, _, k = text.partition(":")
    if k and not k.isdigit():
        raise NpqwenError(f"--speculative: K must be a whole number, got {k!r} (write METHOD:K, e.g. ngram:4)")
    return {"method": method, **({"k": int(k)} if k else {})}


def load_model(args, chat_template: bool = False):
    """The model, and the seconds it took to load; a checkpoint without a tokenizer is refused first
    (every command here starts from text), as is one without a chat template when `chat_template`."""
    from .. import load
    from ..hub import resolve_model

    check_device_dtype(args)
    started = time.perf_counter()
    model = args.model
    from ..tiny import BUILTIN

    if model not in BUILTIN:
        model = resolve_model(model).resolve()   # absolute: a local folder named "tiny" is not the built-in one
        check_checkpoint(model, tokenizer=True)
    share_load(args, str(model))   # tensor parallel: the other ranks load their parts with this rank
    llm = load(model, device=args.device, dtype=args.dtype, tensor_parallel=getattr(args, "comm", None) or False,
               lora=lora_paths(args), weights=args.weights)
    if any(name.startswith("model.language_model.") for name in llm.weights):   # Qwen3.5's image-text layout
        print(f"npqwen: {model} is a Qwen3.5 image-text checkpoint; npqwen uses it for text (its vision tower "
              f"and multi-token-prediction head are not read)", file=sys.stderr)
    if chat_template and llm.tokenizer.chat_template is None:
        instead = {"generate": ", or use --raw for a plain completion", "chat": ""}.get(args.command,
                                                                                       ", or leave out --chat")
        if Path(model).is_file():
            raise NpqwenError(f"{model}: the GGUF file has no tokenizer.chat_template, so messages cannot be "
                              f"formatted; use a file with one{instead}")
        raise NpqwenError(f"{model}: tokenizer_config.json has no chat_template (nor is there a chat_template.jinja), "
                          f"so messages cannot be formatted; add the model's tokenizer_config.json{instead}")
    if args.command in ("generate", "chat") and llm.kind == "embedding":   # as the server's 400 (--allow-generation)
        raise NpqwenError(f"{args.model} is an embedding model (its files say so): it makes vectors, not text; "
                          f"run npqwen embed with it, or give a generation model")
    return llm, time.perf_counter() - started


def check_checkpoint(path: Path, tokenizer: bool):
    """Every command's check of a checkpoint directory (the text commands need its `tokenizer` too):
    what is missing is named all at once, config.json, weights and tokenizer.json."""
    if path.is_file():   # a GGUF file: config, weights and tokenizer in one, checked as it loads
        return
    missing = missing_files(path, tokenizer=True)
    if not missing or (missing == ["tokenizer.json"] and not tokenizer):
        return
    if missing == ["tokenizer.json"]:
        raise NpqwenError(f"{path}: no tokenizer.json, so the text cannot be encoded; the checkpoint directory "
                          f"needs the model's tokenizer.json and tokenizer_config.json (from the same hub repo)")
    raise NpqwenError(f"{path}: no {', no '.join(missing)}; a checkpoint directory holds the model's config.json, "
                      f"*.safetensors weights, tokenizer.json and tokenizer_config.json, all from one hub repo "
                      f"(`hf download {DEFAULT_MODEL} --local-dir DIR` fetches them), or try --model tiny "
                      f"(built in, no files)")


def json_object(line: str) -> dict | None:
    """A line of a JSONL input file as an object, or None (not JSON, or not an object)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def jsonl_objects(name: str, lines: list[tuple[int, str]]) -> list[dict] | None:
    """The objects of a JSONL input, or None for plain text: a file whose first non-blank line is a
    JSON object is JSONL, and then a line that is not one is an error (not a quiet switch to text)."""
    if json_object(lines[0][1]) is None:
        return None
    objects = []
    for n, line in lines:
        try:
            value = json.loads(line)
        except ValueError as e:
            raise NpqwenError(f"{name} line {n}: not valid JSON ({e}); the first line is a JSON object, so "
                              f"the file is read as JSONL, one object per line") from None
        if not isinstance(value, dict):
            raise NpqwenError(f"{name} line {n}: a {type(value).__name__}, not a JSON object; the first line is "
                              f"one, so the file is read as JSONL, one object per line")
        objects.append(value)
    return objects


def checked_text(text: str, what: str) -> str:
    """Refuse text that is not valid UTF-8 (Python keeps undecodable argv bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise NpqwenError(f"the {what} is not valid UTF-8; fix its encoding") from None
    return text


def system_messages(args) -> list[dict]:
    return [{"role": "system", "content": checked_text(args.system, "system message")}] if args.system else []


def prompt_ids(llm, args, prompt: str) -> list[int]:
    if args.chat:
        prompt = llm.chat_prompt(prompt)
    ids = llm.tokenizer.encode(prompt)   # load_model refused a checkpoint without a tokenizer
    if not ids:
        raise NpqwenError("the prompt is empty")
    return ids


def stream_to_stdout(llm, prompt, params, stop_requested=None, steering=None, lora: str | None = None,
                     feature_edits=None):
    """Generate, writing each text piece as it comes; the GenerationResult at the end.

    `stop_requested` (chat: Ctrl-C was pressed) is asked after every piece; when it says yes the
    stream is closed, which aborts its request in the engine, and the result is None."""
    from ..generate import GenerationResult

    result = GenerationResult("", [], "length")
    pieces = llm.stream(prompt, params, result=result, steering=steering, lora=lora,
                        feature_edits=feature_edits)   # nothing runs until the first piece is asked for
    stopped = stop_requested is not None and stop_requested()
    if not stopped:
        for piece in pieces:
            if stop_requested is not None and stop_requested():   # Ctrl-C during the step that made this
                stopped = True                                    # piece: it is not shown
                break
            write_out(piece)
    if stopped:
        pieces.close()   # the generator's `finally` aborts the request and frees its pages
        write_out("\n")
        return None
    write_out("\n")
    return result


def print_stats(result, load_seconds: float | None = None):
    lines = []
    if load_seconds is not None:
        lines.append(f"load: {load_seconds:.2f} s")
    lines.append(f"prompt: {result.prompt_tokens} tokens, {result.prompt_tokens_per_second:.1f} tokens/s")
    lines.append(f"generation: {len(result.token_ids)} tokens, {result.generation_tokens_per_second:.1f} "
                 f"tokens/s ({result.finish_reason})")
    lines.append(f"peak memory: {peak_rss_bytes() / 1e9:.3f} GB")
    print("==========\n" + "\n".join(lines), file=sys.stderr)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: Linux's VmHWM (ru_maxrss would count the peak of the process
    that started this one, kept across fork and exec); elsewhere ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
