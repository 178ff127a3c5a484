"""A process's niceness: the measuring processes run at their command's, whatever Ray started them at.

Without Ray, so that a process raises itself before it loads anything (a process left at 15 beside busy ones gets
about 1% of a core: importing Ray there took seconds).
"""

from __future__ import annotations

import contextlib
import os


def niceness() -> int:
    """This process's niceness (0 where the platform has none): a command's, which the measuring actors it starts
    take (`at_niceness`)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def at_niceness(wanted: int) -> int:
    """Raise this process to the niceness `wanted` (the command's that started it) where it runs below it, as far as
    the user's rights allow; the niceness it runs at then. A Ray worker of a node started otherwise than by shard-ray
    runs 15 nicer than its node's `ray start`; a command niced by its user keeps its actors as nice as it is."""
    if niceness() > wanted:
        with contextlib.suppress(PermissionError):  # lowering niceness needs CAP_SYS_NICE or RLIMIT_NICE
            os.setpriority(os.PRIO_PROCESS, 0, wanted)
    return niceness()
