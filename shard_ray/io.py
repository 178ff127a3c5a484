"""Reading and writing the project's files: JSON or YAML in, atomic writes out."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from shard_ray.errors import ShardRayError, first_line


def read_document(path: str | os.PathLike[str], what: str) -> Any:
    """Parse a JSON or YAML file (YAML when named .yaml or .yml, JSON otherwise) into Python objects."""
    path = Path(path)
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
        # Name the format tried and the ones read, so that a .csv or .toml file is not called invalid CSV
        raise ShardRayError(
            f"{what} file {path} is not valid {'YAML' if is_yaml else 'JSON'} ({first_line(err)}); "
            f"{what} files are read as JSON, or as YAML when named .yaml or .yml"
        ) from err


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
