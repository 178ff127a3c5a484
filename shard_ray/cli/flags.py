"""Flags derived from settings dataclasses, as CleanRL derives its command line from `Args`.

A settings field declared with `setting(default, help)` becomes a flag `--field-name` (or the
`flag` it names); its type gives the parser (ints, floats, strings, `Literal` choices, booleans
as bare flags, tuples as comma-separated lists), its default is the one default the command
has, and `help` is what `--help` shows. Fields without help are not flags.

Every generated flag parses to None when not given, so `settings_from` can merge, in one way
for every command: the dataclass's defaults, then a tuned file's values, then the flags given.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any, Literal, Union

from shard_ray.configfile import dataclass_from, flag_name
from shard_ray.errors import ShardRayError


def _number(kind: type, minimum: float | None, maximum: float | None = None) -> typing.Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if minimum is not None and value < minimum:
            # a minimum this small stands for "above 0" (a rate, a cap): say that, not the epsilon
            bound = "above 0" if 0 < minimum <= 1e-6 else f"at least {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if maximum is not None and value > maximum:
            most = f"{int(maximum):,}" if float(maximum).is_integer() else f"{maximum:g}"
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def a_file_to_write(text: str) -> str:
    """A file to write: its folder must exist, so that a typo in the path is refused, not created silently, and take
    a file; checked before the command works, so that what it measured is not lost at the end for want of a place."""
    if not text.strip():  # Path("") is ".", a folder
        raise argparse.ArgumentTypeError("an empty name; give the file to write")
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the file to write")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {path.parent} does not exist; create it first")
    _check_writable(path.parent)
    return text


def _a_file_named(suffixes: Sequence[str]) -> typing.Callable[[str], str]:
    """`a_file_to_write` whose name ends in one of `suffixes`: the formats a command writes by the name (a table file
    named .csv had been written as JSON)."""

    def parse(text: str) -> str:
        a_file_to_write(text)
        if Path(text).suffix.lower() not in suffixes:
            named = ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]
            raise argparse.ArgumentTypeError(f"{text}: name the file {named}, the formats it is written in")
        return text

    parse.__name__ = "file"
    return parse


def a_folder_to_write(text: str) -> str:
    """A folder to write files in, created where missing: not a file, and inside a folder this user may write in."""
    if not text.strip():  # Path("") is ".": the files would be written among the user's own
        raise argparse.ArgumentTypeError("an empty name; give the folder to write in")
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists())  # the path itself, or at last "." or "/"
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{existing} is a file, not a folder")
    _check_writable(existing)
    return text


def _check_writable(folder: Path) -> None:
    """Refuse a folder no file can be made in, by making one (permissions alone miss read-only file systems, /proc)."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"no file can be made in folder {folder} ({err.strerror or err})") from None


a_file_to_write.__name__ = "file"
a_folder_to_write.__name__ = "folder"


def _listed(item: typing.Callable[[str], Any]) -> typing.Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return tuple(item(p) for p in parts)

    parse.__name__ = "list"
    return parse


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _parser_for(annotation: Any, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """argparse keywords (type, choices) for a field's annotation."""
    annotation = _unwrap_optional(annotation)
    origin = typing.get_origin(annotation)
    minimum = metadata.get("min")
    if origin is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if "choices" in metadata:
        return {"choices": list(metadata["choices"])}
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        parse = _number(item, minimum) if item in (int, float) else item
        if metadata.get("many"):
            return {"type": parse, "nargs": "+"}
        return {"type": parse if metadata.get("whole") else _listed(parse)}
    if annotation in (int, float):
        return {"type": _number(annotation, minimum, metadata.get("max"))}
    if metadata.get("new_file"):
        suffixes = metadata.get("suffixes")
        return {"type": _a_file_named(suffixes) if suffixes else a_file_to_write}
    if metadata.get("new_folder"):
        return {"type": a_folder_to_write}
    if annotation in (str, Path):
        return {"type": annotation}
    raise TypeError(f"no flag parser for {annotation!r}")


def _shown(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, tuple) else str(value)


class _Renamed(argparse.Action):
    """A flag that also answers to its old name, with a one-line notice when the old one is used."""

    def __init__(self, *args: Any, old_names: Sequence[str] = (), **kwargs: Any) -> None:
        self.old_names = tuple(old_names)
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        if option in self.old_names:
            print(f"shard-ray: note: {option} is now {self.option_strings[0]}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_settings(
    parser: argparse.ArgumentParser,
    cls: type,
    defaults: Mapping[str, Any] | None = None,
    exclude: Sequence[str] = (),
    required: Sequence[str] = (),
) -> None:
    """Add a flag for every field of dataclass `cls` that has help; `defaults` overrides shown defaults; the fields in
    `required` are required of this parser's command (a flag other commands sharing `cls` may leave out)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if "help" not in f.metadata or f.name in exclude:
            continue
        meta = f.metadata
        default = (defaults or {}).get(f.name, f.default if f.default is not MISSING else None)
        text = meta["help"]
        if default not in (None, (), "") and not meta.get("required") and hints[f.name] is not bool:
            text += f" (default {_shown(default)})"
        names = [flag_name(f.name, meta)]
        if hints[f.name] is bool:
            parser.add_argument(*names, dest=f.name, action="store_true", default=None, help=text)
            continue
        keywords = _parser_for(hints[f.name], meta)
        old = meta.get("old_names", ())
        if old:
            keywords.update(action=_Renamed, old_names=old)
        if meta.get("repeat"):
            keywords["action"] = "append"
        if "choices" not in keywords:
            keywords["metavar"] = meta.get("metavar") or names[0].lstrip("-").replace("-", "_").upper()
        parser.add_argument(
            *names,
            *old,
            dest=f.name,
            default=None,
            required=bool(meta.get("required")) or f.name in required,
            help=text,
            **keywords,
        )
        if meta.get("new_file"):  # checked against the files the other flags name (`refuse_writing_over_inputs`)
            parser.set_defaults(files_written=(*(parser.get_default("files_written") or ()), (f.name, names[0])))


def refuse_writing_over_inputs(args: argparse.Namespace) -> None:
    """Refuse a file to write that another flag names too (`export --plan plan.json --out plan.json`): the command
    would replace its own input, a table or plan file, with what it writes."""
    for dest, flag in getattr(args, "files_written", ()):
        out = getattr(args, dest, None)
        if out is None or not Path(out).is_file():
            continue
        for name, value in vars(args).items():
            for item in value if isinstance(value, list | tuple) else (value,):
                if name != dest and isinstance(item, str) and Path(item).is_file() and os.path.samefile(item, out):
                    raise ShardRayError(
                        f"{flag} {out} is the file given to --{name.replace('_', '-')}: writing it would replace that "
                        "file; give another name"
                    )


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of `cls` given on the command line (repeated list flags joined into one tuple)."""
    values = {}
    for f in fields(cls):
        value = getattr(args, f.name, None)
        if value is None or "help" not in f.metadata:
            continue
        if f.metadata.get("repeat"):
            value = tuple(item for group in value for item in (group if isinstance(group, tuple) else (group,)))
        elif f.metadata.get("many"):
            value = tuple(value)
        values[f.name] = value
    return values


def merged_settings(
    cls: type,
    args: argparse.Namespace,
    tuned: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    **fixed: Any,
) -> dict[str, Any]:
    """`cls`'s defaults, then `defaults`, then `tuned` (a tuned file's values), then the flags given, then `fixed`."""
    values = asdict(cls())  # every settings field has a default; required flags default to None
    values.update(defaults or {})
    values.update(tuned or {})
    values.update(given(args, cls))
    values.update(fixed)
    return values


def settings_from(
    cls: type,
    args: argparse.Namespace,
    tuned: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    **fixed: Any,
) -> Any:
    """The settings object of `merged_settings`, checked (`cls.check()` where it has one); bad values are one-line errors."""
    return dataclass_from(cls, merged_settings(cls, args, tuned, defaults, **fixed), f"{cls.__name__} settings")
