"""`npqwen generate`: one prompt streamed to stdout, or a --prompts-file run together through one
engine, its results as JSONL in input order."""
import json
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field, replace

from ..chat_format import check_roles
from ..errors import NpqwenError
from .common import (CONSTRAINT_FIELDS, ENGINE_SIZES, SAMPLING_FIELDS, add_engine_sizes, check_writable,
                     checked_text, chosen_lora, command_line_params, constraint_options, engine_sizes, input_name,
                     jsonl_objects, load_model, lora_options, model_options, peak_rss_bytes, print_stats,
                     read_input_file, sampling_options,
                     stream_to_stdout, system_messages, write_out)
from .common import (checked_command_line_feature_edits, checked_command_line_steering, command_line_feature_edits,
                     command_line_steering, feature_edit_options, steering_options)
from .parallel import add_option
from .progress import Progress


def add_parser(commands):
    p = commands.add_parser("generate", parents=[model_options(), lora_options(), sampling_options(),
                                                 constraint_options(), steering_options(),
                                                 feature_edit_options()],
                            help="complete one prompt, streaming; or a file of prompts, batched")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", "-p", help="the prompt ('-' reads it from stdin)")
    source.add_argument("--prompts-file", metavar="FILE",
                        help="many prompts, run together through one engine: one per line, or JSONL lines with "
                             "\"prompt\" or \"messages\" and optional sampling and constraint fields ('-' reads "
                             "stdin)")
    p.add_argument("--lora-name", metavar="NAME",
                   help="generate through the --lora adapter called NAME (default: the only --lora given, if one)")
    p.add_argument("--raw", action="store_true",
                   help="plain completion: do not apply the chat template (default: the chat template)")
    batch = p.add_argument_group("with --prompts-file")
    batch.add_argument("--output", "-o", metavar="OUT.jsonl", help="write the results here (default: stdout)")
    add_engine_sizes(batch)
    add_option(p)
    p.set_defaults(run=cmd_generate)


def cmd_generate(args) -> int:
    if args.raw and args.system is not None:   # the system message is a part of the chat template
        raise NpqwenError("--system goes with the chat template, which --raw leaves out: put the system text in "
                          "the prompt, or leave out --raw")
    if args.prompts_file is not None:
        return generate_file(args)
    given = [f"--{name.replace('_', '-')}" for name in ("output", *ENGINE_SIZES) if getattr(args, name) is not None]
    if args.no_prefix_cache:
        given.append("--no-prefix-cache")
    if given:
        raise NpqwenError(f"{given[0]} goes with --prompts-file, not --prompt")
    if args.prompt == "-":
        try:
            args.prompt = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise NpqwenError(f"the prompt on stdin is not valid UTF-8 ({e})") from None
    prompt = checked_text(args.prompt, "prompt")
    system = system_messages(args)
    # a bad value shows before the (slow) load; with thinking, a constraint applies after the free reasoning
    params = command_line_params(args, thinking=not args.raw and not args.no_think)
    steering, edits = command_line_steering(args), command_line_feature_edits(args)
    lora = chosen_lora(args)
    llm, load_seconds = load_model(args, chat_template=not args.raw)
    steering = checked_command_line_steering(steering, llm, args)
    edits = checked_command_line_feature_edits(edits, llm, args)
    if not args.raw:
        prompt = llm.chat_prompt(system + [{"role": "user", "content": prompt}], enable_thinking=not args.no_think)
    print_stats(stream_to_stdout(llm, prompt, params, steering=steering, lora=lora, feature_edits=edits),
                load_seconds)
    return 0




@dataclass
class FilePrompt:
    """One prompt of a --prompts-file, with the line it came from."""
    line: int                                      # 1-based line number in the file
    prompt: str | None = None                      # a plain line, or JSONL "prompt": templated unless --raw
    messages: list | None = None                   # JSONL "messages": always templated
    sampling: dict = field(default_factory=dict)   # JSONL sampling fields: they override the command line
    constraint: dict = field(default_factory=dict)  # JSONL json_schema, regex, choice or grammar: replaces the
                                                    # command line's constraint


def read_prompts_file(path: str) -> list[FilePrompt]:
    """The prompts in FILE: JSONL if its first non-blank line is a JSON object, else one prompt per line."""
    name, text = input_name(path), read_input_file(path)
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise NpqwenError(f"{name}: no prompts in it ({'every line is blank' if text else 'the file is empty'})")
    objects = jsonl_objects(name, lines)
    if objects is None:
        return [FilePrompt(n, prompt=line) for n, line in lines]
    return [file_prompt(f"{name} line {n}", n, o) for (n, _), o in zip(lines, objects)]


def file_prompt(where: str, n: int, obj: dict) -> FilePrompt:
    """A JSONL line: "prompt" (a string) or "messages" (a chat), and sampling fields (null = not given)."""
    unknown = [k for k in obj if k not in ("prompt", "messages", *SAMPLING_FIELDS, *CONSTRAINT_FIELDS)]
    if unknown:
        raise NpqwenError(f"{where}: unknown field {unknown[0]!r}; a line has \"prompt\" or \"messages\" and "
                          f"optionally {', '.join(SAMPLING_FIELDS)} and one of {', '.join(CONSTRAINT_FIELDS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise NpqwenError(f"{where}: needs \"prompt\" (a string) or \"messages\" (a list of chat messages), "
                          f"{'not both' if 'prompt' in obj else 'and has neither'}")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if "prompt" in obj and not isinstance(prompt, str):
        raise NpqwenError(f"{where}: \"prompt\" must be a string, got {json.dumps(prompt)[:60]}")
    if "messages" in obj and not (isinstance(messages, list) and messages
                                  and all(isinstance(m, dict) for m in messages)):
        raise NpqwenError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                          f"objects, got {json.dumps(messages)[:60]}")
    if "messages" in obj:
        try:
            check_roles(messages)   # before the load, as the chat template would refuse them after it
        except NpqwenError as e:
            raise NpqwenError(f"{where}: {e}") from None
    try:   # JSON can escape a lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text holds
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise NpqwenError(f"{where}: a string in it is not valid UTF-8 (an unpaired surrogate escape)") from None
    return FilePrompt(n, prompt, messages, {k: v for k, v in obj.items() if k in SAMPLING_FIELDS and v is not None},
                      {k: v for k, v in obj.items() if k in CONSTRAINT_FIELDS and v is not None})


def generate_file(args) -> int:
    """--prompts-file: every prompt through one engine; the results as JSONL, in input order."""
    from ..engine import Engine
    from ..engine.run import run

    name = input_name(args.prompts_file)
    # The command line's values alone first, so a bad one is not blamed on line 1; then the file's own
    # mistakes; all before the (slow) load.
    params = command_line_params(args, thinking=False)
    steering, edits = command_line_steering(args), command_line_feature_edits(args)
    system_messages(args)
    if args.output:
        check_writable(args.output, "--output")
    prompts = read_prompts_file(args.prompts_file)
    lora = chosen_lora(args)
    llm, load_seconds = load_model(args, chat_template=not args.raw or any(p.messages for p in prompts))
    steering = checked_command_line_steering(steering, llm, args)
    edits = checked_command_line_feature_edits(edits, llm, args)
    engine = Engine(llm, **engine_sizes(args))
    # Every request is made (and so checked) before the first step; one bad line stops them all.
    requests = []
    for p in prompts:
        try:
            requests.append(engine.new_request(file_prompt_text(llm, args, p), line_params(params, args, p),
                                               steering=steering, lora=lora, feature_edits=edits))
        except NpqwenError as e:
            raise NpqwenError(f"{name} line {p.line}: {e}") from None
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:
        raise NpqwenError(f"{args.output}: cannot write it ({e.strerror or e})") from None
    index = {r.request_id: i for i, r in enumerate(requests)}
    budget = {r.request_id: r.max_new_tokens for r in requests}
    results, written, started = {}, 0, time.perf_counter()
    try:
        with Progress(len(prompts), work=sum(budget.values())) as progress, closing(run(engine, requests)) as outputs:
            for o in outputs:
                progress.advance(len(o.token_ids))
                if o.finished:
                    results[index[o.request_id]] = o.result
                    progress.finish_one(budget[o.request_id] - len(o.result.token_ids))
                if written in results and out is sys.stdout:
                    progress.clear()        # a result on the terminal must not land inside the progress line
                while written in results:   # in input order: write each result once those before it are written
                    write_record(out, json.dumps(result_record(written, prompts[written], results[written]),
                                                 ensure_ascii=False) + "\n", args.output)
                    written += 1
                progress.show()
    finally:
        if out is not sys.stdout:
            out.close()
    print_batch_stats(list(results.values()), time.perf_counter() - started, engine.stats, load_seconds)
    if args.output:
        print(f"wrote {written} results to {args.output}", file=sys.stderr)
    return 0


def line_params(params, args, p: FilePrompt):
    """A line's SamplingParams: the command line's, with the line's own sampling values, its constraint
    in place of the command line's, and thinking when it is templated with thinking on."""
    constraint = {**dict.fromkeys(CONSTRAINT_FIELDS), **p.constraint} if p.constraint else {}
    thinking = not args.no_think and (p.messages is not None or not args.raw)
    return replace(params, **p.sampling, **constraint, thinking=thinking)


def write_record(out, line: str, output: str | None):
    """One JSON line to --output or stdout, flushed; a failed write (disk full) is one clear error."""
    if out is sys.stdout:
        return write_out(line)
    try:
        out.write(line)
        out.flush()
    except OSError as e:
        raise NpqwenError(f"{output}: cannot write it ({e.strerror or e})") from None


def file_prompt_text(llm, args, p: FilePrompt) -> str:
    """The text the engine gets: a plain or "prompt" line under the chat template unless --raw; messages always."""
    if p.messages is not None:
        return llm.chat_prompt(p.messages, enable_thinking=not args.no_think)
    if args.raw:
        return p.prompt
    return llm.chat_prompt(system_messages(args) + [{"role": "user", "content": p.prompt}],
                           enable_thinking=not args.no_think)


def result_record(i: int, p: FilePrompt, result) -> dict:
    source = {"prompt": p.prompt} if p.messages is None else {"messages": p.messages}
    return {"index": i, **source, "text": result.text, "token_ids": [int(t) for t in result.token_ids],
            "finish_reason": result.finish_reason, "prompt_tokens": result.prompt_tokens,
            "generated_tokens": len(result.token_ids), **({"error": result.error} if result.error else {})}


def print_batch_stats(results: list, seconds: float, stats: dict, load_seconds: float):
    generated = sum(len(r.token_ids) for r in results)
    reasons = {}
    for r in results:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    lines = [f"load: {load_seconds:.2f} s",
             f"prompts: {len(results)}, {sum(r.prompt_tokens for r in results)} tokens "
             f"({stats['prefix_cache_hit_tokens']} from the prefix cache)",
             f"generation: {generated} tokens in {seconds:.2f} s, {generated / seconds if seconds else 0.0:.1f} "
             f"tokens/s ({', '.join(f'{n} {reason}' for reason, n in sorted(reasons.items()))})",
             f"preemptions: {stats['preemptions']}",
             f"peak memory: {peak_rss_bytes() / 1e9:.3f} GB"]
    print("==========\n" + "\n".join(lines), file=sys.stderr)


