"""Settings: fields that are flags, tuned-config files, and flags from a YAML file.

`setting` declares a settings-dataclass field that is also a command-line flag; `dataclass_from`
builds a settings object from plain values; `load_tuned` reads a tuned-config file (`best.json`
of a sweep):

    {"format": "shard-ray-tuned/1", "kind": "costmodel", "config": {...},
     "metric": "val_mape", "mode": "min", "value": 0.061, "trials": 16, "sweep": "OUT/tune/costmodel"}

Flags from a YAML file: `--config FILE` for the experiment scripts run as Ray jobs.

A config file is a mapping of flag names (with `_` or `-`) to values; it expands into flags
placed before the command line's own, so the parser that reads them is the command's own
(an unknown key is an unknown flag) and a flag given on the command line wins. Lists become
comma-separated values, `true` a bare flag; `false` and `null` leave the flag out.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from dataclasses import field, fields
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from shard_ray.errors import ShardRayError, describe_validation_error, did_you_mean
from shard_ray.io import read_document

TUNED_FORMAT = "shard-ray-tuned/1"
Kind = Literal["costmodel", "search", "policy"]


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A settings-dataclass field that is also a command-line flag (see `shard_ray.cli.flags`).

    `flag` may name the flag (`flag="--epochs"`), its old names (`old_names=("--pool",)`), a minimum (`min=1`) and a
    maximum (`max=4096`), `choices`, `required=True`, `repeat=True` for a flag given once per value, `many=True` for a
    flag followed by its values (`--plans a.json b.json`), `whole=True` for a list flag whose values are not split at
    commas, `new_file=True` for a file to write, whose folder must exist (and with `suffixes=(".json", ...)` whose name
    ends so), or `new_folder=True` for a folder to write in,
    created where missing.
    """
    return field(default=default, metadata={"help": help, **flag})


def flag_name(field_name: str, metadata: Mapping[str, Any]) -> str:
    """The flag of a `setting` field, as the command line spells it."""
    return metadata.get("flag") or "--" + field_name.replace("_", "-")


def flags_of(*settings: type) -> dict[str, str]:
    """Each `setting` field of the settings dataclasses `settings` by name, with its flag."""
    return {f.name: flag_name(f.name, f.metadata) for c in settings for f in fields(c) if "help" in f.metadata}


def differences(earlier: Mapping[str, Any], now: Mapping[str, Any], labels: Mapping[str, str]) -> list[str]:
    """Each value two records of settings give otherwise, as `LABEL EARLIER there, NOW now` (by its label, its
    flag say, where `labels` has one): what a command refusing to resume a folder of other settings names."""
    return [
        f"{labels.get(name, name)} {earlier.get(name)} there, {now.get(name)} now"
        for name in dict.fromkeys([*now, *earlier])
        if earlier.get(name) != now.get(name)
    ]


class TunedConfig(BaseModel):
    """The best configuration a sweep found."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["shard-ray-tuned/1"] = TUNED_FORMAT
    kind: Kind
    config: dict[str, Any]
    metric: str
    mode: Literal["min", "max"]
    value: float
    trials: int
    sweep: str
    notes: dict[str, Any] = {}


def load_tuned(path: str | Path, kind: Kind) -> dict[str, Any]:
    """The configuration in a tuned-config file of `kind`."""
    document = read_document(path, "tuned config")
    if not isinstance(document, dict) or document.get("format") != TUNED_FORMAT:
        raise ShardRayError(f'{path} is not a tuned-config file (expected "format": "{TUNED_FORMAT}")')
    try:
        tuned = TunedConfig.model_validate(document)
    except ValidationError as err:
        raise ShardRayError(describe_validation_error(err, f"tuned config {path}")) from None
    if tuned.kind != kind:
        raise ShardRayError(f"{path} holds a tuned {tuned.kind} configuration, not a {kind} one")
    return tuned.config


def dataclass_from(cls: type, values: dict[str, Any], what: str) -> Any:
    """`cls(**values)`, each value checked against its field's type (lists become tuples: JSON has
    none), unknown keys refused, then `cls.check()` where it has one; bad values are one-line errors."""
    known = {f.name for f in fields(cls)}  # not `__dataclass_fields__`, which holds its ClassVars too (`RETIRED`)
    unknown = sorted(set(values) - known)
    if unknown:
        retired = getattr(cls, "RETIRED", {})  # settings of earlier releases: what replaced them

        def named(name: str) -> str:
            close = did_you_mean(name, known)  # "; did you mean X?"
            why = retired[name] if name in retired else close.removeprefix("; ")
            return f"{name} ({why})" if why else name

        raise ShardRayError(
            f"{what}: unknown setting(s) {', '.join(map(named, unknown))}; its settings are {', '.join(sorted(known))}"
        )
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if typing.get_origin(hints[name]) is tuple and not isinstance(value, (list, tuple)):
            raise ShardRayError(f"{what}: {name} takes a list, e.g. {name}=[{value}], got {value!r}")
    try:
        config = TypeAdapter(cls).validate_python(values)
    except ValidationError as err:
        raise ShardRayError(describe_validation_error(err, what)) from None
    if hasattr(config, "check"):
        config.check()
    return config


def config_to_argv(config: dict[str, Any], what: str = "config") -> list[str]:
    argv: list[str] = []
    for key, value in config.items():
        if not isinstance(key, str) or not key:
            raise ShardRayError(f"{what}: keys must be flag names, got {key!r}")
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(str(v) for v in value)]
        elif isinstance(value, (str, int, float)):
            argv += [flag, str(value)]
        else:
            raise ShardRayError(f"{what}: {key} must be a number, string, boolean or list, got {type(value).__name__}")
    return argv


def read_config(path: str) -> dict[str, Any]:
    document = read_document(path, "experiment config")
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ShardRayError(f"experiment config {path} must be a mapping of flag names to values")
    return document


def expand_config(argv: Sequence[str] | None) -> list[str]:
    """`argv` with `--config FILE` (or `--config=FILE`) replaced by the file's flags, placed first."""
    argv = list(argv or [])
    rest, path = [], None
    i = 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if path is None:
        return rest
    return config_to_argv(read_config(path), f"experiment config {path}") + rest
