"""Errors that flame reports to the user as a single line and a non-zero exit."""


class ConfigError(ValueError):
    """Bad user input: a config value, a path, a degree. The message names the value."""


class NonFiniteError(RuntimeError):
    """Training produced a NaN/Inf loss or gradient norm; the run stops before saving anything."""
