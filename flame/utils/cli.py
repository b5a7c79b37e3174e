"""The argument parser of flame's ``python -m`` commands: a bad argument is one line, as elsewhere."""
from __future__ import annotations

import argparse
import sys


class CliParser(argparse.ArgumentParser):
    """argparse with flame's error form: ``flame: error: <what argparse found>`` on stderr, exit 2,
    instead of the usage block and the program's name (``--help`` still prints the usage)."""

    def error(self, message: str):
        print(f"flame: error: {message}", file=sys.stderr)
        sys.exit(2)
