"""One thread for the small networks' arithmetic in a command's own process."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager


@contextmanager
def one_thread() -> Iterator[None]:
    """numpy's BLAS, and torch where it is loaded, on one thread for the block: pricing, searching and training the
    cost models and the policy, whose networks are small enough that one thread is faster than several. Beside a busy
    process a library's threads spin against the load: Criteo Kaggle's cost_search took 1.7 s on one torch thread and
    29 s on two beside a running test suite, a PPO iteration of the suite's policy 0.3 s and 17 s beside three busy
    processes. (The profiling actors and the gang's members set their own threads.) Pricing imports no torch
    (`shard_ray.costmodel.models`): it is limited only where something else loaded it."""
    from threadpoolctl import threadpool_limits

    with ExitStack() as stack:
        stack.enter_context(threadpool_limits(limits=1, user_api="blas"))
        if "torch" in sys.modules:
            torch = sys.modules["torch"]
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        yield
