"""A progress line on stderr for commands that run many prompts through the engine."""
import sys
import time


class Progress:
    """done/total, generated tokens/s and ETA on stderr: on a terminal one line redrawn with \\r,
    elsewhere (a log, a pipe) a plain line every PLAIN_EVERY seconds and at the end."""
    TTY_EVERY, PLAIN_EVERY, WIDTH = 0.1, 10.0, 20

    def __init__(self, total: int, budget: int, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total, self.budget = total, budget   # prompts; the most tokens they may generate (max_new_tokens)
        self.done = self.tokens = self.spent = 0  # finished prompts; tokens generated; budget generated or let go
        self.started = time.perf_counter()
        self.shown, self.width = self.started, 0

    def advance(self, tokens: int):
        self.tokens += tokens
        self.spent += tokens

    def finish_one(self, unused: int):
        """A prompt finished, `unused` tokens short of its max_new_tokens (eos or a stop string)."""
        self.done += 1
        self.spent += unused

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        elapsed = self.elapsed()
        fraction = self.spent / self.budget if self.budget and self.done < self.total else 1.0
        filled = round(fraction * self.WIDTH)
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        if self.done == self.total:
            eta = f"took {duration(elapsed)}"
        else:   # as if the rest runs at the speed so far, every prompt using its whole max_new_tokens
            eta = f"ETA {duration(elapsed * (1 - fraction) / fraction)}" if fraction > 0 else "ETA ?"
        return (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} done, "
                f"{self.tokens} tokens, {rate:.1f} tokens/s, {eta}")

    def show(self, final: bool = False):
        now = time.perf_counter()
        if not final and now - self.shown < (self.TTY_EVERY if self.tty else self.PLAIN_EVERY):
            return
        self.shown, text = now, self.line()
        if self.tty:   # redraw in place; spaces wipe what a longer earlier line left
            self.stream.write("\r" + text + " " * max(0, self.width - len(text)) + ("\n" if final else ""))
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self):
        """Wipe the terminal's progress line (before a result is printed to the same terminal)."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


