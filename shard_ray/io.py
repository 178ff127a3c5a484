"""Reading and writing the project's files: JSON or YAML in, atomic writes out."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import tempfile
import typing
import zipfile
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import yaml
from pydantic import BaseModel, ValidationError

from shard_ray.errors import ShardRayError, describe_validation_error, first_line

M = TypeVar("M", bound=BaseModel)
# The names a document is written and read as YAML by; JSON otherwise.
YAML_SUFFIXES = (".yaml", ".yml")
DOCUMENT_SUFFIXES = (".json", *YAML_SUFFIXES)


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
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, as some Windows editors write, read past
    except (OSError, UnicodeDecodeError) as err:
        raise ShardRayError(f"cannot read {what} file {path}: {err}") from err
    if not text.strip():
        raise ShardRayError(f"{what} file {path} is empty")
    is_yaml = _named_yaml(path)
    try:
        return yaml.load(text, _UniqueKeyLoader) if is_yaml else json.loads(text, object_pairs_hook=_unique_keys)
    except _RepeatedKey as err:
        raise ShardRayError(
            f"{what} file {path}: {err.args[0]!r} is given twice in one entry{err.args[1]}; give it once"
        ) from None
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


class _RepeatedKey(Exception):
    """A key given twice in one object or mapping: (the key, where), which JSON and YAML readers otherwise take as
    the last value given, silently (a table's `rows` written twice planned with the second)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) < len(pairs):  # a plan's `tables` holds thousands of keys: counted once, not key by key
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key, "")
            seen.add(key)
    return document


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (keys a merge (`<<`) brings may be given again:
    that is what a merge is for)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _RepeatedKey(key, f" (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _trailing_comma(err: json.JSONDecodeError) -> str:
    """Where JSON found nothing after a comma (a last entry with a comma after it, which JavaScript allows), the
    comma's place: Python's message points past it, at the next line's `]` or `}`."""
    before = err.doc[: err.pos].rstrip()
    if not before.endswith(",") or err.doc[err.pos : err.pos + 1] not in ("]", "}"):
        return ""
    line = before.count("\n") + 1
    column = len(before) - (before.rfind("\n") + 1)
    return f"; a comma with nothing after it at line {line} column {column}?"


def refuse_other_kind(document: Any, what: str, path: str | os.PathLike[str]) -> None:
    """Refuse, by what it is, a table file given where a plan file is asked for, or a plan file where a table file is:
    each was refused field by field (`num_devices: Field required; algorithm: ...`), which does not say the slip."""
    if not isinstance(document, dict):
        return
    if what != "table" and isinstance(document.get("tables"), list) and "shards" not in document:
        raise ShardRayError(f"{path} is a table file (a 'tables' list, no 'shards'), not a {what} file")
    if what != "plan" and "shards" in document and "num_devices" in document:
        raise ShardRayError(f"{path} is a plan file ('shards' on 'num_devices'), not a {what} file")


def read_model(path: str | os.PathLike[str], what: str, model: type[M], expected: str) -> M:
    """A JSON or YAML file of an object validated as `model`; one-line errors naming the file and the field."""
    document = read_document(path, what)
    refuse_other_kind(document, what, path)
    if not isinstance(document, dict):
        raise ShardRayError(f"{what} file {path}: expected {expected}")
    try:
        return model.model_validate(document)
    except ValidationError as err:
        raise ShardRayError(
            describe_validation_error(err, f"{what} file {path}", document, lambda at: fields_at(model, at))
        ) from err


def fields_at(model: type[BaseModel], location: tuple) -> set[str]:
    """The names of the fields a key at `location` in a file of `model` may have (the fields of the models nested
    there, in lists and mappings too): what a misspelt key is checked against, at its own level (a plan's top-level
    `colour` was asked whether it meant a shard's `columns`)."""
    models = {model}
    for part in location:
        fields = {name: info for current in models for name, info in current.model_fields.items()}
        info = fields.get(part) if isinstance(part, str) else None
        if info is None:  # a list's index or a mapping's key (a table's name): the same models hold its entries
            continue
        nested, stack = set(), [info.annotation]
        while stack:
            kind = stack.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                nested.add(kind)
            stack.extend(typing.get_args(kind))
        models = nested
    return {info.alias or name for current in models for name, info in current.model_fields.items()}


# What a shard-ray `.pt` file's pickle may name, as torch.load(weights_only=True) allows it: the tensors' storages by
# their dtype (those the project's files hold), the function rebuilding a tensor from its storage, and a state dict's
# OrderedDict.
_STORAGE_DTYPES = {
    "FloatStorage": "f4",
    "DoubleStorage": "f8",
    "HalfStorage": "f2",
    "LongStorage": "i8",
    "IntStorage": "i4",
    "ShortStorage": "i2",
    "CharStorage": "i1",
    "ByteStorage": "u1",
    "BoolStorage": "b1",
}


class _Unreadable(Exception):
    """Why a file is not read as a shard-ray `.pt` file, in words for the user."""


class _TensorsAsArrays(pickle.Unpickler):
    """torch.save's pickle read without torch: each tensor a numpy array of its own, of its dtype, shape and values,
    read from its storage in the file's byte order; any other class refused, as torch.load(weights_only=True) refuses
    it."""

    def __init__(self, archive: zipfile.ZipFile, prefix: str) -> None:
        super().__init__(io.BytesIO(archive.read(prefix + "data.pkl")))
        self.archive, self.prefix = archive, prefix
        names = set(archive.namelist())
        order = archive.read(prefix + "byteorder").decode().strip() if prefix + "byteorder" in names else "little"
        if order not in ("little", "big"):
            raise _Unreadable(f"its byte order is {order[:20]!r}")
        self.order = "<" if order == "little" else ">"

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _array_of_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return np.dtype(self.order + _STORAGE_DTYPES[name])
        if module == "torch" and name.endswith("Storage"):
            raise _Unreadable(f"it holds a tensor of {name.removesuffix('Storage')}, where the project saves float32")
        raise _Unreadable(f"its pickle names {module}.{name}, which is not a tensor's part")

    def persistent_load(self, pid: Any) -> np.ndarray:
        kind, dtype, key, _location, count = pid
        if kind != "storage" or not isinstance(dtype, np.dtype):
            raise _Unreadable(f"a storage of unknown kind {kind!r}")
        data = self.archive.read(f"{self.prefix}data/{key}")
        if not isinstance(count, int) or not 0 <= count * dtype.itemsize <= len(data):
            raise _Unreadable(f"a storage of {count} items holds {len(data)} bytes")
        return np.frombuffer(data, dtype=dtype, count=count)


def _array_of_tensor(
    storage: np.ndarray, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], *_grad_and_hooks: Any
) -> np.ndarray:
    """A tensor torch.save wrote, as a native-endian numpy array of its own (torch's `_rebuild_tensor_v2`'s
    arguments); a shape, offset or strides reaching outside its storage is refused, as torch refuses it."""
    numbers = [offset, *shape, *strides]
    if len(shape) != len(strides) or not all(isinstance(n, int) and n >= 0 for n in numbers):
        raise _Unreadable(f"a tensor of shape {shape} and strides {strides} at {offset}")
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    if 0 not in shape and last >= len(storage):
        raise _Unreadable(f"a tensor of shape {tuple(shape)} reaches past its storage of {len(storage)} items")
    items = storage[offset:] if 0 not in shape else storage[:0]
    view = np.lib.stride_tricks.as_strided(items, shape, tuple(s * items.itemsize for s in strides), writeable=False)
    return np.array(view, dtype=view.dtype.newbyteorder("="))


def read_torch_file(
    data: bytes, source: str, what: str, holding: str, file_format: str, written_by: str, *older_formats: str
) -> dict:
    """The dict in a shard-ray `.pt` file's content, its tensors numpy arrays, checked for `file_format` (or one of
    the `older_formats` the caller still reads). Read without torch, which takes a second to import where a plan
    takes less (docs/commands.md): torch.save's zip format (torch 1.6 and later), tensors of the dtypes `.pt` files
    of this project hold, and none of what torch.load(weights_only=True) refuses.

    `source` names the file in errors, `what` its kind ("cost model"), `holding` what it holds
    ("shard-ray cost models") and `written_by` the command that writes it.
    """
    try:
        try:
            archive = zipfile.ZipFile(io.BytesIO(data))
        except zipfile.BadZipFile:
            raise _Unreadable("it is not torch.save's zip archive (torch 1.6 and later write one)") from None
        with archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise _Unreadable("its archive has no data.pkl, as torch.save writes one")
            blob = _TensorsAsArrays(archive, pickles[0][: -len("data.pkl")]).load()
    except _Unreadable as err:
        raise ShardRayError(
            f"cannot read {what} file {source}: not a PyTorch file of {holding} (format {file_format}, as "
            f"{written_by}): {err}"
        ) from None
    except Exception as err:  # a damaged archive or pickle fails in many ways
        raise ShardRayError(
            f"cannot read {what} file {source}: not a PyTorch file of {holding} (format {file_format}, as "
            f"{written_by}): {type(err).__name__}: {first_line(err)}"
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


def write_document(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as `read_document` reads it back: YAML when the file is named .yaml or .yml, JSON otherwise."""
    if _named_yaml(Path(path)):
        write_atomic(path, yaml.safe_dump(obj, sort_keys=False))
    else:
        write_json(path, obj)


def _named_yaml(path: Path) -> bool:
    return path.suffix.lower() in YAML_SUFFIXES
