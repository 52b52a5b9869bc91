"""The progress line of a command that runs many items through the engine (generate --prompts-file):
items done of the total, tokens and tokens/s, an ETA, on stderr.

tqdm draws it: on a terminal one line redrawn in place; where stderr is not a terminal (a log, a
pipe) a plain line every LOG_EVERY seconds and one at the end. When the run ends in an error the
line is wiped (a terminal) or not written (a log), so the error is the last line.

    with Progress(len(prompts), work=sum(max_new_tokens)) as progress:
        ...                          # for each engine step:
        progress.advance(tokens)     # tokens generated (counted in the line and in the work)
        progress.finish_one(unused)  # an item finished, `unused` units of its work let go
        progress.show()              # redrawn if its interval has passed
"""
import sys

from tqdm import tqdm

TERMINAL_EVERY, LOG_EVERY = 0.1, 10.0   # seconds between two lines: redrawn on a terminal, new in a log
BAR_FORMAT = "[{bar:20}] {done}/{items} done, {tokens} tokens, {tokens_per_second:.1f} tokens/s, {eta}"


class Progress(tqdm):
    """tqdm counts the work (the bar and the ETA follow it); this adds the items and the tokens.

    For generate the work is the prompts' max_new_tokens added up: a prompt that ends early (eos,
    a stop string) lets go of the rest of its share, so the ETA assumes the rest runs to the full length."""
    monitor_interval = 0   # no tqdm monitor thread: show() is called after every step

    def __init__(self, items: int, work: int, stream=None):
        stream = stream or sys.stderr
        terminal = stream.isatty()
        self.items, self.done, self.tokens, self.spent = items, 0, 0, 0
        super().__init__(total=work, file=stream if terminal else LogLines(stream),
                         mininterval=TERMINAL_EVERY if terminal else LOG_EVERY, delay=0 if terminal else LOG_EVERY,
                         miniters=0, smoothing=0, ascii=".#", dynamic_ncols=terminal, bar_format=BAR_FORMAT)

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self.leave = False   # an error line follows: tqdm wipes the progress line instead of keeping it
        elif self.last_print_t < self.start_t + self.delay:
            self.refresh()       # a log's run shorter than its first interval: tqdm would leave it without a line
        return super().__exit__(exc_type, *rest)

    def advance(self, tokens: int):
        self.tokens += tokens
        self.spent += tokens

    def finish_one(self, unused: int = 0):
        self.done += 1
        self.spent += unused

    def show(self):
        """Hand tqdm the work done so far; it draws when its interval has passed."""
        self.update((self.total if self.done == self.items else self.spent) - self.n)

    @property
    def format_dict(self):   # tqdm's values, and the ones BAR_FORMAT adds
        d = super().format_dict
        elapsed, fraction = d["elapsed"], d["n"] / d["total"] if d["total"] else 1.0
        if self.done == self.items:
            eta = f"took {duration(elapsed)}"
        else:   # as if the rest runs at the speed so far
            eta = f"ETA {duration(elapsed * (1 - fraction) / fraction)}" if fraction > 0 else "ETA ?"
        d.update(done=self.done, items=self.items, tokens=self.tokens, eta=eta,
                 tokens_per_second=self.tokens / elapsed if elapsed > 0 else 0.0)
        return d


class LogLines:
    """tqdm's output where stderr is not a terminal: each redraw ("\\r", the line, spaces) as a plain line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str):
        line = text.replace("\r", "").strip()
        if line:   # tqdm's wipes (spaces) and its closing "\n" are no line of their own
            self.stream.write(line + "\n")

    def flush(self):
        self.stream.flush()


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
