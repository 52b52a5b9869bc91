"""`npqwen chat`: a multi-turn conversation on the terminal, each answer streamed."""
import contextlib
import signal
import sys

from ..chat_format import THINK_OPEN, opens_reasoning, split_reasoning
from ..comm import GroupFailed
from ..errors import NpqwenError
from .common import (OutputError, checked_text, chosen_lora, command_line_params, constraint_options, load_model,
                     lora_options, model_options, print_stats, sampling_options, steering_options, stream_to_stdout,
                     system_messages, write_out)
from .common import (checked_command_line_feature_edits, checked_command_line_steering, command_line_feature_edits,
                     command_line_steering, feature_edit_options)
from .parallel import add_option


HELP = """/help, /?      this list
/reset         clear the history (the system message stays)
/exit, /quit   quit (so do Ctrl-D, and Ctrl-C at the prompt)
Ctrl-C during an answer stops it; the answer is not kept in the history.
Up and down arrows recall earlier lines. Anything else is sent to the model."""
TINY_NOTE = " (random weights: its text is meaningless, it is for stepping through the code)"


def add_parser(commands):
    p = commands.add_parser("chat", parents=[model_options(), lora_options(), sampling_options(),
                                             constraint_options(), steering_options(),
                                             feature_edit_options()],
                            help="interactive multi-turn chat",
                            description="Multi-turn chat. /help lists the commands; /reset clears the history; "
                                        "/exit, Ctrl-D or Ctrl-C at the prompt quits; Ctrl-C during an answer stops "
                                        "that answer (it is not kept in the history). Arrow keys edit the line and "
                                        "recall earlier ones.")
    p.add_argument("--lora-name", metavar="NAME",
                   help="answer through the --lora adapter called NAME (default: the only --lora given, if one)")
    add_option(p)
    p.set_defaults(run=cmd_chat)


def cmd_chat(args) -> int:
    params = command_line_params(args, thinking=not args.no_think)   # checked before the (slow) load
    system = system_messages(args)
    steering, edits = command_line_steering(args), command_line_feature_edits(args)
    lora = chosen_lora(args)
    llm, _ = load_model(args, chat_template=True)
    steering = checked_command_line_steering(steering, llm, args)
    edits = checked_command_line_feature_edits(edits, llm, args)
    history = list(system)
    line_editing()
    from ..tiny import BUILTIN

    note = TINY_NOTE if args.model in BUILTIN else ""
    print(f"npqwen chat with {args.model}{note}. /help lists the commands; /reset clears the history; /exit, "
          f"Ctrl-D or Ctrl-C quits; Ctrl-C during an answer stops it.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):   # Ctrl-D, or Ctrl-C at the prompt: quit
            print(file=sys.stderr)
            return 0
        except UnicodeDecodeError:
            print("npqwen: error: that input is not valid UTF-8; try again", file=sys.stderr)
            continue
        except OSError as e:   # input() writes ">>> " to stdout: a full disk or a closed terminal
            raise OutputError(f"cannot use stdout or stdin ({e.strerror or e})") from None
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command in ("/help", "/?"):
            print(HELP, file=sys.stderr)
            continue
        if command == "/reset":
            history = list(system)
            print("(history cleared)", file=sys.stderr)
            continue
        if not command:
            continue
        try:
            checked_text(line, "message")
            messages = history + [{"role": "user", "content": line}]
            with ctrl_c_sets_a_flag() as pressed:   # from Enter to the answer's end: Ctrl-C stops the answer
                prompt, ids = chat_ids(llm, messages, args, earlier_turns=len(history) > len(system))
                if not args.no_think and opens_reasoning(prompt):   # Qwen3.5's template opened it: show the tag
                    write_out(prompt[prompt.rindex(THINK_OPEN):])
                result = stream_to_stdout(llm, ids, params, stop_requested=pressed, steering=steering,
                                          lora=lora, feature_edits=edits)
        except (OutputError, GroupFailed):   # stdout is gone, or a rank of the model: nothing more can be done
            raise
        except NpqwenError as e:   # e.g. the conversation outgrew the context: say so and keep going
            print(f"npqwen: error: {e}", file=sys.stderr)
            continue
        if result is None:
            # A stopped answer is dropped: the next turn reads as if the question had not been answered,
            # rather than as an answer that ends mid-sentence.
            print("(answer stopped; it is not kept in the history; Ctrl-C again or /exit quits)", file=sys.stderr)
            continue
        # Qwen3 keeps only the final answer of earlier turns, not their reasoning.
        content = split_reasoning(result.text, not args.no_think, opens_reasoning(prompt))[1]
        history = messages + [{"role": "assistant", "content": content}]
        print_stats(result)
        if len(ids) + len(result.token_ids) >= llm.config.max_position_embeddings:
            print(f"(the conversation fills the context of {llm.config.max_position_embeddings} tokens, so the "
                  f"answer was cut; /reset clears the history)", file=sys.stderr)


def chat_ids(llm, messages, args, earlier_turns: bool) -> tuple[str, list[int]]:
    """The conversation under the chat template, as text and token ids; one that leaves no room to answer
    is refused with a message that names the history, which is what grew."""
    prompt = llm.chat_prompt(messages, enable_thinking=not args.no_think)
    ids = llm.tokenizer.encode(prompt)
    context = llm.config.max_position_embeddings
    if len(ids) >= context and earlier_turns:
        raise NpqwenError(f"the conversation has outgrown the context: the history and this message are {len(ids)} "
                          f"tokens, the model holds {context}; /reset clears the history")
    if len(ids) >= context:
        raise NpqwenError(f"this message is {len(ids)} tokens under the chat template, the model holds {context}; "
                          f"send a shorter one")
    return prompt, ids


def line_editing():
    """Arrow keys edit the line and recall earlier lines: importing readline is enough for input() to use it."""
    try:
        import readline  # noqa: F401
    except ImportError:   # e.g. Windows without pyreadline: plain input() still works
        pass


@contextlib.contextmanager
def ctrl_c_sets_a_flag():
    """Inside, a first Ctrl-C only sets a flag (read between two text pieces), so it never lands in the
    middle of an engine step; a second one raises KeyboardInterrupt as usual (and quits)."""
    pressed = []

    def on_ctrl_c(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


