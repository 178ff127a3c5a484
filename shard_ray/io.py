"""Reading and writing the project's files: JSON or YAML in, atomic writes out."""

from __future__ import annotations

import io
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from shard_ray.errors import ShardRayError, describe_validation_error, first_line

M = TypeVar("M", bound=BaseModel)


def shard_ray_home() -> Path:
    """shard-ray's folder for what outlives a command (calibrated models, emulated clusters): $SHARD_RAY_HOME,
    else ~/.shard-ray."""
    return Path(os.environ.get("SHARD_RAY_HOME") or Path.home() / ".shard-ray")


def read_document(path: str | os.PathLike[str], what: str) -> Any:
    """Parse a JSON or YAML file (YAML when named .yaml or .yml, JSON otherwise) into Python objects."""
    path = Path(path)
    if path.is_dir():
        raise ShardRayError(f"{path} is a folder, not a {what} file: give the file in it")
    if not path.is_file():
        raise ShardRayError(f"{what} file not found: {path}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ShardRayError(f"cannot read {what} file {path}: {err}") from err
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    try:
        return yaml.safe_load(text) if is_yaml else json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        detail = first_line(err)
        mark = getattr(err, "problem_mark", None)  # YAML's own message names the construct, not where it broke
        if mark is not None:
            detail = f"{getattr(err, 'problem', None) or detail}: line {mark.line + 1} column {mark.column + 1}"
        elif isinstance(err, json.JSONDecodeError):
            detail += _trailing_comma(err)
        # Name the format tried and the ones read, so that a .csv or .toml file is not called invalid CSV
        raise ShardRayError(
            f"{what} file {path} is not valid {'YAML' if is_yaml else 'JSON'} ({detail}); "
            f"{what} files are read as JSON, or as YAML when named .yaml or .yml"
        ) from err


def _trailing_comma(err: json.JSONDecodeError) -> str:
    """Where JSON found nothing after a comma (a last entry with a comma after it, which JavaScript allows), the
    comma's place: Python's message points past it, at the next line's `]` or `}`."""
    before = err.doc[: err.pos].rstrip()
    if not before.endswith(",") or err.doc[err.pos : err.pos + 1] not in ("]", "}"):
        return ""
    line = before.count("\n") + 1
    column = len(before) - (before.rfind("\n") + 1)
    return f"; a comma with nothing after it at line {line} column {column}?"


def read_model(path: str | os.PathLike[str], what: str, model: type[M], expected: str) -> M:
    """A JSON or YAML file of an object validated as `model`; one-line errors naming the file and the field."""
    document = read_document(path, what)
    if not isinstance(document, dict):
        raise ShardRayError(f"{what} file {path}: expected {expected}")
    try:
        return model.model_validate(document)
    except ValidationError as err:
        raise ShardRayError(describe_validation_error(err, f"{what} file {path}", document)) from err


def read_torch_file(
    data: bytes, source: str, what: str, holding: str, file_format: str, written_by: str, *older_formats: str
) -> dict:
    """The dict in a shard-ray `.pt` file's content, read with torch.load(weights_only=True) and checked
    for `file_format` (or one of the `older_formats` the caller still reads).

    `source` names the file in errors, `what` its kind ("cost model"), `holding` what it holds
    ("shard-ray cost models") and `written_by` the command that writes it.
    """
    import torch

    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files that are not ours
            warnings.simplefilter("ignore")
            blob = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:  # torch.load raises many types for a bad file
        # torch's own first line is its weights_only=False advice, wrong for a file that is not ours
        raise ShardRayError(
            f"cannot read {what} file {source}: not a PyTorch file of {holding} "
            f"(format {file_format}, as {written_by}; read with torch.load(weights_only=True))"
        ) from err
    if not isinstance(blob, dict) or blob.get("format") not in (file_format, *older_formats):
        raise ShardRayError(f"{source} is not a shard-ray {what} file ({file_format})")
    return blob


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write a file so that readers see either the old content or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; give it an ordinary file's mode
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")
