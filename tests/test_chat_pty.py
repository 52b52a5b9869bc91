"""`npqwen chat` on a real terminal (a pseudo-terminal driven by pexpect): Ctrl-C stops an answer and
keeps the chat going, the arrow keys recall earlier lines, /exit quits with status 0."""
import re
import sys

import pytest

from conftest import ROOT

pexpect = pytest.importorskip("pexpect", reason="pexpect is not installed (pip install pexpect, or the test extra)")

if sys.platform == "win32":
    pytest.skip("pexpect.spawn needs a POSIX pseudo-terminal", allow_module_level=True)

PROMPT = ">>> "
STATS = re.compile(r"prompt: (\d+) tokens")


def start_chat(max_new_tokens: int):
    # Greedy, so every answer runs its full length: the tiny model decodes ~1,500 tokens/s, and an
    # answer of 3,500 tokens is long enough for the Ctrl-C to arrive while it streams.
    chat = pexpect.spawn(sys.executable, ["-m", "npqwen", "chat", "--model", "tiny", "-n", str(max_new_tokens),
                                          "-t", "0"], cwd=str(ROOT), encoding="utf-8", codec_errors="replace",
                         timeout=60, dimensions=(40, 200))
    chat.expect_exact(PROMPT)
    return chat


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on():
    chat = start_chat(3500)
    try:
        chat.sendline("first message")
        chat.expect_exact("first message\r\n")  # the terminal's echo
        chat.expect(".")                        # the answer has started to stream
        chat.sendintr()
        chat.expect_exact("(answer stopped; it is not kept in the history")
        chat.expect_exact(PROMPT)               # back at the prompt, not out of the program
        assert chat.isalive()
        chat.sendline("second message")
        chat.expect(STATS)                      # the second answer runs to its end and reports
        second = int(chat.match.group(1))
        chat.expect_exact(PROMPT)
        # Arrow up recalls "second message" (readline history); Enter sends it again, after a turn
        # of 3,500 tokens: the conversation no longer fits the tiny model's 4,096 positions.
        chat.send("\x1b[A")
        chat.expect_exact("second message")
        chat.send("\r")
        chat.expect_exact("the conversation has outgrown the context")
        chat.expect_exact("/reset clears the history")
        chat.expect_exact(PROMPT)
        chat.sendline("/reset")
        chat.expect_exact("(history cleared)")
        chat.expect_exact(PROMPT)
        chat.send("\x1b[A\x1b[A")               # past "/reset", to "second message" again
        chat.expect_exact("second message")
        chat.send("\r")
        chat.expect(STATS)
        # The same prompt as the second turn's: the stopped first answer was not kept in the history.
        assert int(chat.match.group(1)) == second
        chat.expect_exact(PROMPT)
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0, chat.before


def test_ctrl_c_at_the_prompt_quits():
    chat = start_chat(4)
    try:
        chat.sendintr()
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0, chat.before
