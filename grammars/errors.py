"""The one error type of `grammars`."""


class GrammarError(ValueError):
    """A constraint that cannot be built or followed: invalid or unsupported schema or regex, or a dead end."""
