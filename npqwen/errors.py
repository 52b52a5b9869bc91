"""The one exception type for mistakes a user can make (bad path, config, weights, prompt, sampling value)."""


class NpqwenError(Exception):
    """A problem with the user's input; the message says what was wrong and what to do."""
