"""The ``lmdock`` command's argument parser: argparse, with errors that say what to type instead.

An unknown flag gets a did-you-mean from the subcommand's own flags, and the flags vLLM's, llama.cpp's
and OpenAI's users type out of habit are named with lmdock's equivalent (a flag of the command, or
the config key that holds the setting) rather than a bare "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from lmdock._config.foreign import FOREIGN_FLAGS


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose "unrecognized arguments" error suggests the right flag.

    Each parser keeps the flags it was given (``flags``); the top-level one is told its subcommands
    (``commands``) so that a hint draws on the flags of the subcommand being run.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: list[str] = []  # before argparse's own __init__, which adds -h
        super().__init__(*args, **kwargs)
        self.commands: Mapping[str, Parser] = {}
        self.argv: list[str] = []

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.flags += action.option_strings
        return action

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(self.argv, namespace)

    def error(self, message: str) -> NoReturn:
        hint = self.hint(message)
        if hint:
            message = f"{message}; {hint}"
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def hint(self, message: str) -> str:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = self.flags + next((self.commands[a].flags for a in self.argv if a in self.commands), [])
        hints = []
        for flag in (a.split("=", 1)[0] for a in message[len(prefix):].split() if a.startswith("-")):
            if flag in FOREIGN_FLAGS:
                hints.append(f"{flag}: lmdock's is {FOREIGN_FLAGS[flag]}")
            elif close := difflib.get_close_matches(flag, known, n=1, cutoff=0.7):
                hints.append(f"{flag}: did you mean {close[0]}?")
        return "; ".join(hints)
