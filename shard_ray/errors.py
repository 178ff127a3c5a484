"""The one error type for problems a user can fix (bad files, flags, infeasible requests).

The CLI turns it into a one-line message and exit status 2; everything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

from pydantic import ValidationError


class ShardRayError(Exception):
    """A problem with the user's input or request, reported without a traceback."""


class ShardRayWarning(UserWarning):
    """Something a user should know that does not stop the command; the CLI prints it in one line."""


class InfeasibleError(ShardRayError):
    """No placement fits: the tables do not fit the devices' memory the way an algorithm places them.

    Comparisons and benchmarks record only this as "the algorithm could not plan the task"; any
    other error (a broken model or policy file) stops them.
    """


def first_line(err: BaseException) -> str:
    """An exception's first message line, or its type's name when it has no message."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def describe_validation_error(err: ValidationError, what: str) -> str:
    """One line naming the first invalid field of `what` and why."""
    first = err.errors()[0]
    location = ".".join(str(part) for part in first["loc"]) or "(root)"
    message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
    return f"{what}: {location}: {message}"
