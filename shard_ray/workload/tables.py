"""Table specs and table files: the workload's input format.

A table file is JSON or YAML: ``{"tables": [{"name": "t0", "rows": 1000, "dim": 64,
"pooling_factor": 4.0}, ...]}``. Optional fields and their defaults are on `TableSpec`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shard_ray.errors import ShardRayError, describe_validation_error, did_you_mean
from shard_ray.io import fields_at, read_document, refuse_other_kind, write_document

if TYPE_CHECKING:
    import numpy as np

# Access-count bins of the reuse histogram, as published for Meta's dlrm_datasets:
# fraction of unique rows accessed k times with k in (0,1], (1,2], (2,4], ..., (16384,32768], more.
REUSE_BINS = 17
DEFAULT_ZIPF_EXPONENT = 1.05
BYTES_PER_ELEMENT = {"fp32": 4, "fp16": 2}


@dataclass(frozen=True)
class TableBatch:
    """One batch of one table's lookups, as the fbgemm kernels take them."""

    indices: np.ndarray  # int64 row ids, sample-major
    lengths: np.ndarray  # int64 lookups per sample


class TraceRef(BaseModel):
    """Where a table's real index batches live: table `table_index` of a dlrm_datasets file."""

    model_config = ConfigDict(extra="forbid")
    path: str
    table_index: int = Field(ge=0)


def written_as_number(value: Any) -> Any:
    """`value`, a field of a file that must be a number (or a list of numbers), checked to be written as one: pydantic
    would read `true` as 1 row and "1000" as 1000, a file's slip planned as a table. Finite before the range checks,
    which NaN fails with a message about the range. A field validator's (mode="before") body."""
    if isinstance(value, list | tuple):
        return [written_as_number(item) for item in value]
    if isinstance(value, str) and _reads_as_number(value):
        # YAML reads 2e6 (no point in it, no sign to its exponent) as text, where JSON and Python read a number
        how = "unquote it"
        if "e" in value.lower():
            mantissa, exponent = f"{float(value):e}".split("e")
            plain = f"{float(value):.0f}" if float(value).is_integer() else repr(float(value))
            how = f"YAML reads such a number as text: write it {plain} or {float(mantissa)}e{int(exponent):+d}"
        raise ValueError(f"must be a number, got the text {json.dumps(value)}: {how}")
    if isinstance(value, bool | str):
        raise ValueError(f"must be a number, got {json.dumps(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _reads_as_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


class TableSpec(BaseModel):
    """One embedding table.

    `zipf_exponent` and `reuse_histogram` are the two ways to give the access distribution;
    give at most one. With neither, accesses follow Zipf with exponent 1.05.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    rows: int = Field(gt=0, le=2**43)
    dim: int = Field(gt=0, le=4096)
    pooling_factor: float = Field(gt=0, le=10_000)  # beyond any real feature; bounds batch memory
    zipf_exponent: float | None = Field(default=None, ge=0.0, le=10.0)
    reuse_histogram: tuple[float, ...] | None = None
    precision: Literal["fp32", "fp16"] = "fp32"
    trace: TraceRef | None = None

    @field_validator("dim")
    @classmethod
    def _dim_multiple_of_4(cls, dim: int) -> int:
        if dim % 4:
            raise ValueError(f"must be a multiple of 4 (fbgemm's requirement), got {dim}")
        return dim

    @field_validator("name", mode="before")
    @classmethod
    def _a_text(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(
                f"must be text, got {json.dumps(value)} (YAML reads on, off, yes and no unquoted so): quote it"
            )
        if isinstance(value, int | float):
            raise ValueError(f"must be text, got {json.dumps(value)}: quote it")
        return value

    @field_validator("rows", "dim", "pooling_factor", "zipf_exponent", mode="before")
    @classmethod
    def _a_finite_number(cls, value: Any) -> Any:
        return written_as_number(value)

    @field_validator("reuse_histogram")
    @classmethod
    def _histogram_shape(cls, hist: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if hist is None:
            return None
        if len(hist) != REUSE_BINS:
            raise ValueError(f"must have {REUSE_BINS} bins, got {len(hist)}")
        if any(not math.isfinite(p) or p < 0 for p in hist) or sum(hist) <= 0:
            raise ValueError("must be non-negative finite fractions with a positive sum")
        total = sum(hist)
        # Normalise once: renormalising an already normalised histogram drifts by an ulp,
        # which would make a table differ from itself after a save and load.
        return hist if abs(total - 1.0) < 1e-9 else tuple(p / total for p in hist)

    @model_validator(mode="after")
    def _one_distribution(self) -> TableSpec:
        if self.zipf_exponent is not None and self.reuse_histogram is not None:
            raise ValueError("give either zipf_exponent or reuse_histogram, not both")
        return self

    @property
    def bytes_per_element(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def effective_zipf_exponent(self) -> float:
        return DEFAULT_ZIPF_EXPONENT if self.zipf_exponent is None else self.zipf_exponent

    def with_dim(self, dim: int) -> TableSpec:
        return self.model_copy(update={"dim": dim})


# `dir(torch.nn.ModuleDict)` at the torch pyproject.toml pins, the names TorchRec refuses as table names: written out so
# that reading a table file does not import torch (2 s of every command that reads one, refusals and `tasks`
# included); tests/test_workload.py checks them against the torch installed.
MODULE_DICT_ATTRIBUTES = frozenset(
    """
    T_destination __annotations__ __call__ __class__ __contains__ __delattr__ __delitem__ __dict__ __dir__ __doc__
    __eq__ __format__ __ge__ __getattr__ __getattribute__ __getitem__ __getstate__ __gt__ __hash__ __init__
    __init_subclass__ __iter__ __le__ __len__ __lt__ __module__ __ne__ __new__ __reduce__ __reduce_ex__ __repr__
    __setattr__ __setitem__ __setstate__ __sizeof__ __str__ __subclasshook__ __weakref__ _apply _call_impl
    _compiled_call_impl _get_backward_hooks _get_backward_pre_hooks _get_name _load_from_state_dict
    _maybe_warn_non_full_backward_hook _named_members _register_load_state_dict_pre_hook _register_state_dict_hook
    _replicate_for_data_parallel _save_to_state_dict _slow_forward _version _wrapped_call_impl add_module apply
    bfloat16 buffers call_super_init children clear compile cpu cuda double dump_patches eval extra_repr float
    forward get_buffer get_extra_state get_parameter get_submodule half ipu items keys load_state_dict modules mtia
    named_buffers named_children named_modules named_parameters parameters pop register_backward_hook
    register_buffer register_forward_hook register_forward_pre_hook register_full_backward_hook
    register_full_backward_pre_hook register_load_state_dict_post_hook register_load_state_dict_pre_hook
    register_module register_parameter register_state_dict_post_hook register_state_dict_pre_hook requires_grad_
    set_extra_state set_submodule share_memory state_dict to to_empty train type update values xpu zero_grad
    """.split()
)


def torchrec_name_problem(name: str) -> str | None:
    """Why TorchRec cannot take `name` as a table name, or None.

    TorchRec keeps an EmbeddingBagCollection's tables in a torch.nn.ModuleDict keyed by name,
    which refuses '.' (the separator of parameter paths) and the ModuleDict's own attribute names.
    """
    if "." in name:
        return (
            f"table name {name!r} contains '.', which TorchRec refuses in table names (any other character is allowed)"
        )
    if name in MODULE_DICT_ATTRIBUTES:
        return f"table name {name!r} is an attribute of torch.nn.ModuleDict, which TorchRec refuses as a table name"
    return None


class TableFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    tables: list[TableSpec] = Field(min_length=1)

    @field_validator("tables")
    @classmethod
    def _names(cls, tables: list[TableSpec]) -> list[TableSpec]:
        # Names are checked here, not on TableSpec, so that cost-data variants built in code keep theirs.
        seen: set[str] = set()
        for table in tables:
            if table.name in seen:
                raise ValueError(f"duplicate table name {table.name!r}")
            problem = torchrec_name_problem(table.name)
            if problem:
                # Plans and exports name tables as the model's EmbeddingBagCollection must, so refuse here
                raise ValueError(f"{problem}; rename the table")
            seen.add(table.name)
        return tables


def task_digest(tables: list[TableSpec]) -> str:
    """Which tables a plan was made for, or models calibrated on: a digest of their specs, whatever their order."""
    specs = sorted(_spec(t) for t in tables)
    return hashlib.sha256(json.dumps(specs).encode()).hexdigest()[:12]


def table_digests(tables: list[TableSpec]) -> dict[str, str]:
    """Each table's own digest of its spec, by name: which of a plan's tables changed shape since (`task_digest` says
    only that one did)."""
    return {t.name: hashlib.sha256(_spec(t).encode()).hexdigest()[:8] for t in tables}


def _spec(table: TableSpec) -> str:
    return json.dumps(table.model_dump(mode="json"), sort_keys=True)


def validate_tables(tables: list[TableSpec]) -> list[TableSpec]:
    """Apply the table file's rules (non-empty, unique names) to tables built in code."""
    try:
        return TableFile(tables=tables).tables
    except ValidationError as err:
        # the field is named `tables` too: "tables: duplicate table name 'a'", where it read "tables: tables: ..."
        raise ShardRayError(describe_validation_error(err, "tables").removeprefix("tables: ")) from err


def load_tables(path: str | os.PathLike[str]) -> list[TableSpec]:
    """Read and validate a table file (JSON or YAML)."""
    document = read_document(path, "table")
    refuse_other_kind(document, "table", path)
    if not isinstance(document, dict) or "tables" not in document:
        keys = [str(key) for key in document] if isinstance(document, dict) else []
        misspelt = next((hint for hint in (did_you_mean(key, ["tables"]) for key in keys) if hint), "")
        found = f" (its keys: {', '.join(keys)}{misspelt})" if keys else ""
        raise ShardRayError(f"table file {path}: expected an object with a 'tables' list{found}")
    try:
        tables = TableFile.model_validate(document).tables
    except ValidationError as err:
        raise ShardRayError(
            describe_validation_error(err, f"table file {path}", document, lambda at: fields_at(TableFile, at))
        ) from err
    # a trace is read where the table's shards are measured, after Ray has started (`profile` stored such a table's
    # shards as infeasible and exited 0): its file is looked for here, where the table file is read
    for table in tables:
        if table.trace is not None and not os.path.isfile(table.trace.path):
            where = "" if os.path.isabs(table.trace.path) else f" (a relative path is read from {os.getcwd()})"
            raise ShardRayError(
                f"table file {path}: table {table.name!r}: trace file {table.trace.path} not found{where}"
            )
    return tables


def save_tables(path: str | os.PathLike[str], tables: list[TableSpec], **metadata: object) -> None:
    """Write a table file (YAML when named .yaml or .yml, JSON otherwise), leaving out fields at their defaults so
    files stay readable."""
    write_document(
        path,
        {"tables": [t.model_dump(exclude_none=True, exclude_defaults=True, mode="json") for t in tables], **metadata},
    )
