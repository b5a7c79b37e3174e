"""Errors that flame reports to the user as a single line and a non-zero exit."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type name when it has none): for one-line errors."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


class ConfigError(ValueError):
    """Bad user input: a config value, a path, a degree. The message names the value."""


class NonFiniteError(RuntimeError):
    """Training produced a NaN/Inf loss or gradient norm; the run stops before saving anything."""
