"""Torch on one thread in a command's own process, where its work is small networks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for the block: pricing, searching and training the cost models and the policy, whose
    networks are small enough that one thread is faster than several. Beside a busy process torch's threads spin
    against the load: Criteo Kaggle's cost_search took 1.7 s on one thread and 29 s on two beside a running test
    suite, a PPO iteration of the suite's policy 0.3 s and 17 s beside three busy processes. (The profiling
    actors and the gang's members set their own threads.)"""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
