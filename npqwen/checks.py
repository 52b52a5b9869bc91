"""Checks of values a caller passes in, shared by the model, the engine and the APIs: one rule each."""
import numbers

import numpy as np

from .backend import to_numpy
from .errors import NpqwenError


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a bool (True is an int to Python, never a count or an id here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_ids(token_ids, vocab_size: int) -> np.ndarray:
    """The one rule for token ids (llm.forward and prompts alike): a 1-D list, tuple, range or integer
    array of ids in 0 .. vocab_size - 1, as an int64 host array (possibly empty: the caller decides)."""
    if isinstance(token_ids, (list, tuple, range)):
        bad = next(((i, t) for i, t in enumerate(token_ids) if not is_integer(t)), None)
        if bad is not None:
            i, t = bad
            hint = "; pass one sequence at a time" if isinstance(t, (list, tuple, range, np.ndarray)) else ""
            raise NpqwenError(f"token ids must be a 1-D sequence of integers, got {type(t).__name__} {str(t)[:40]} "
                              f"at index {i}{hint}")
        try:
            ids = np.array(token_ids, dtype=np.int64).reshape(-1)
        except OverflowError:   # an id beyond int64 (JSON has no limit): outside any vocabulary
            bad = next(t for t in token_ids if not -2 ** 63 <= t < 2 ** 63)
            raise NpqwenError(f"token id {bad} is outside the vocabulary 0 .. {vocab_size - 1}") from None
    elif getattr(token_ids, "ndim", 0) >= 1 and hasattr(token_ids, "dtype"):   # a NumPy or CuPy array
        ids = np.asarray(to_numpy(token_ids))
        if ids.ndim != 1:
            raise NpqwenError(f"token ids must be a 1-D array, got shape {ids.shape}; pass one sequence at a time")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise NpqwenError(f"token ids must be integers, got an array of dtype {ids.dtype}; "
                              f"convert it with .astype(int) if the values are whole")
    else:
        hint = " (encode text first: llm.tokenizer.encode)" if isinstance(token_ids, (str, bytes)) else ""
        raise NpqwenError(f"token ids must be a 1-D list, tuple, range or integer array, got "
                          f"{type(token_ids).__name__} {str(token_ids)[:40]!r}{hint}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise NpqwenError(f"token id {bad} is outside the vocabulary 0 .. {vocab_size - 1}")
    return ids.astype(np.int64)
