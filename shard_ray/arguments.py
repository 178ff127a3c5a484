"""The argument parser of every command line: `shard-ray`, `python -m shard_ray.interop.torchrec_step` and the
experiments (`python experiments/NAME.py`)."""

from __future__ import annotations

import argparse
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from shard_ray.errors import did_you_mean

# How argparse begins the refusal of a command missing flags it requires.
REQUIRED = "the following arguments are required: "


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line with the prefix of every other user error, suggests the
    flag or choice a misspelling was meant to be, and takes no abbreviations."""

    def __init__(self, *args: Any, elsewhere: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        """`elsewhere`: for a choice a user may type that is not one, where what it names is found (said instead of
        the closest choice)."""
        kwargs.setdefault("allow_abbrev", False)  # `--device 2` must not pass for `--devices 2`
        kwargs.setdefault("prog", typed_command())
        self.elsewhere = dict(elsewhere or {})
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        self._arguments = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            # A command's own parser refuses what it does not know, so that the message can name its flags
            self.error(self._unrecognized([e for e in extras if e.startswith("-")] or extras))
        return namespace, extras

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        unknown = [
            a for a in getattr(self, "_arguments", []) if a.startswith("--") and a.split("=")[0] not in self._flags()
        ]
        if unknown and self._subparsers is None and message.startswith(REQUIRED):
            message = self._unrecognized(unknown)  # a misspelt flag is why the flag it meant is missing
        elif message.startswith(REQUIRED):  # each said with what it is
            missing = message.removeprefix(REQUIRED).split(", ")
            message = REQUIRED + ", ".join(
                f"{flag} ({what})" if (what := self._what(flag)) else flag for flag in missing
            )
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice and choice[1] in self.elsewhere:
            message += f"; {self.elsewhere[choice[1]]}"
        elif choice:  # the choices are quoted up to Python 3.12, bare after
            message += did_you_mean(choice[1], [c.strip("'") for c in choice[2].split(", ")])
        help_hint = f" (see {self.prog} --help)" if self.prog != "shard-ray" else ""
        self.exit(2, f"shard-ray: error: {message}{help_hint}\n")

    def _unrecognized(self, unknown: Sequence[str]) -> str:
        noun = "argument" if len(unknown) == 1 else "arguments"
        return f"unrecognized {noun} {' '.join(unknown)}" + did_you_mean(unknown[0].split("=")[0], self._flags())

    def _what(self, flag: str) -> str:
        """What `flag` is, as its help begins (up to its first parenthesis or semicolon), or ""."""
        first = flag.split("/")[0]  # argparse names a flag's aliases `--tables/--pool`
        action = next((a for a in self._actions if first in a.option_strings), None)
        return re.split(r" \(|;", action.help or "")[0].strip() if action is not None else ""

    def _flags(self) -> list[str]:
        return [option for action in self._actions for option in action.option_strings]


def typed_command() -> str:
    """This process's command as a user types it, for its usage line and errors: `python -m MODULE` for a module run
    with -m, else `python SCRIPT` with the script's path as given."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
