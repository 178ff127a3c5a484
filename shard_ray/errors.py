"""The one error type for problems a user can fix (bad files, flags, infeasible requests).

The CLI turns it into a one-line message and exit status 2; everything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Collection, Iterable

from pydantic import ValidationError


class ShardRayError(Exception):
    """A problem with the user's input or request, reported without a traceback."""


class ShardRayWarning(UserWarning):
    """Something a user should know that does not stop the command; the CLI prints it in one line."""


class Terminated(KeyboardInterrupt):
    """A SIGTERM (`timeout`, a scheduler, `kill`), raised where the command runs, so that it stops as a Ctrl-C stops it:
    its local Ray stopped, nothing half-written, one line and status 143."""


def raise_terminated(signum: int, frame: object) -> None:
    """The commands' SIGTERM handler (`shard_ray.cli.main` installs it; `connect_ray` again after `ray.init`, which
    installs Ray's, whose driver then aborted with a crash dump). Ray's waits (`ray.get`) turn what a handler raises
    into a KeyboardInterrupt: `sigterm_received` says it was a SIGTERM all the same."""
    _SIGTERMS.append(signum)
    raise Terminated


_SIGTERMS: list[int] = []


def sigterm_received(forget: bool = False) -> bool:
    """Whether `raise_terminated` ran since the last `forget`."""
    received = bool(_SIGTERMS)
    if forget:
        _SIGTERMS.clear()
    return received


class InfeasibleError(ShardRayError):
    """No placement fits: the tables do not fit the devices' memory the way an algorithm places them.

    Comparisons and benchmarks record only this as "the algorithm could not plan the task"; any
    other error (a broken model or policy file) stops them.
    """


class UnplaceableError(InfeasibleError):
    """No algorithm places the tables, however it splits them: they need more memory than the devices hold together,
    a table split every way its constraints allow leaves a piece over a device's, or they allow it no way."""


def first_line(err: BaseException) -> str:
    """An exception's first message line, or its type's name when it has no message."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# The most invalid fields one message names; past them it says how many more there are.
MOST_FIELDS_NAMED = 3


def describe_validation_error(
    err: ValidationError, what: str, document: object = None, known: Callable[[tuple], Collection[str]] | None = None
) -> str:
    """One line naming the invalid fields of `what` and why (`MOST_FIELDS_NAMED` at most), so that a file with two
    mistakes is mended in one go; given the `document` validated, an entry of a list that has a name is called by
    it (`table 'C4': rows`, not `tables.3.rows`). A field not allowed beside a required one missing from the same
    entry, whose name is close to it, is named as a misspelling of it (`poolin_factor: not a field (did you mean
    pooling_factor?)`) in place of the two; any other not allowed, where close to one of the field names `known`
    gives for the entry holding it (`not_type`: `not_types`)."""
    errors = err.errors()
    missing = {tuple(e["loc"]) for e in errors if e["type"] == "missing"}
    meant: set[tuple] = set()
    problems = []
    for error in errors:
        loc = tuple(error["loc"])
        message = _in_own_words(error)
        if error["type"] == "extra_forbidden" and loc:
            fields = {str(m[-1]): m for m in missing if m[:-1] == loc[:-1] and m not in meant}
            close = difflib.get_close_matches(str(loc[-1]), list(fields), n=1, cutoff=0.6)
            if close:
                meant.add(fields[close[0]])
                message = f"not a field (did you mean {close[0]}?)"
            else:
                allowed = sorted(known(loc[:-1])) if known else []
                close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
                # where none is close, the fields allowed, in place of pydantic's "Extra inputs are not permitted"
                message = (
                    f"not a field (did you mean {close[0]}?)"
                    if close
                    else "not a field" + (f" (the fields here: {', '.join(allowed)})" if allowed else "")
                )
        problems.append((loc, message))
    described = [f"{_location(loc, document)}: {message}" for loc, message in problems if loc not in meant]
    described.sort(key=lambda line: "did you mean" not in line)  # a misspelt key first: it hides other errors
    more = len(described) - MOST_FIELDS_NAMED
    named = "; ".join(described[:MOST_FIELDS_NAMED]) + (f"; and {more} more" if more > 0 else "")
    return f"{what}: {named}"


def _in_own_words(error: dict) -> str:
    """pydantic's message for one invalid field, in the words of shard-ray's own ("must be more than 0" where pydantic
    says "Input should be greater than 0"); a validator's own message without pydantic's prefix."""
    limit = error.get("ctx") or {}
    choice = f"must be {limit.get('expected')}, got {_shown(error.get('input'))}"  # pydantic's literal and enum
    words = {
        "missing": "missing: it is required",
        "greater_than": f"must be more than {limit.get('gt')}",
        "greater_than_equal": f"must be at least {limit.get('ge')}",
        "less_than": f"must be less than {limit.get('lt')}",
        "less_than_equal": f"must be at most {limit.get('le')}",
        "too_short": "must not be empty" if limit.get("min_length") == 1 else None,
        "string_too_short": "must not be empty" if limit.get("min_length") == 1 else None,
        "literal_error": choice,
        "enum": choice,
        "int_from_float": f"must be a whole number, got {_shown(error.get('input'))}",
        "int_parsing_size": f"{_shown(error.get('input'))} is too large a number",
    }.get(error["type"])
    return words or error["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own message


def _shown(value: object) -> str:
    """A value as the file writes it: JSON's spelling where it has one (`"int8"`, `10.5`, `1e+30`)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _location(loc: tuple, document: object) -> str:
    """Where an invalid field is: `table 'C4': rows` where the document's list entry has a name (`table 'a' (#3)` where
    another has it too), else `table #4: rows`,
    counted from 1 as a reader counts the file's entries (pydantic's `tables.3.rows` counts from 0)."""
    named = _named_entry(document, loc)
    if named:
        entry, depth = named
    else:
        indices = [depth for depth, part in enumerate(loc, start=1) if isinstance(part, int) and depth >= 2]
        if not indices:
            return ".".join(str(part) for part in loc) or "(root)"
        depth = indices[-1]
        entry = f"#{loc[depth - 1] + 1}"
    above, rest = ".".join(str(part) for part in loc[: depth - 2]), ".".join(str(part) for part in loc[depth:])
    return (
        (f"{above}: " if above else "")
        + f"{str(loc[depth - 2]).removesuffix('s')} {entry}"
        + (f": {rest}" if rest else "")
    )


def _named_entry(document: object, location: tuple) -> tuple[str, int] | None:
    """How the innermost named list entry on `location` in `document` is called, and how deep it lies: its name, and
    where another entry of its list has that name too, its place (`'a' (#3)`: a walk could not tell which of two
    tables named `a` an error was about)."""
    found = None
    for depth, part in enumerate(location, start=1):
        entries = document
        try:
            document = document[part]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            break
        if (
            isinstance(part, int)
            and depth >= 2
            and isinstance(document, dict)
            and isinstance(document.get("name"), str)
        ):
            name = document["name"]
            alike = sum(isinstance(e, dict) and e.get("name") == name for e in entries)  # type: ignore[union-attr]
            found = (repr(name) + (f" (#{part + 1})" if alike > 1 else ""), depth)
    return found


def did_you_mean(given: str, known: Iterable[str]) -> str:
    """ "; did you mean X?" for the known name closest to a misspelt `given`, or "" when none is close.

    Flags are compared without their dashes, which every flag shares: with them, `--bogus` was "close" to `--out`."""
    bare = {name.lstrip("-"): name for name in known}
    close = difflib.get_close_matches(given.lstrip("-"), list(bare), n=1, cutoff=0.6)
    return f"; did you mean {bare[close[0]]}?" if close else ""
