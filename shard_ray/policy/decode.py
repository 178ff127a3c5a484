"""Placing a task with a trained policy: greedy decoding, sampling, and rescue sampling.

Greedy decoding takes each step's most likely option; with `samples` > 0 it also draws that
many plans from the policy and keeps the one the cost models price lowest. Should every one of
them get stuck (a table fits on no device), it goes on sampling, up to `RESCUE_SAMPLES` plans,
until one fits. No Ray: the policy runs in the caller's process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shard_ray.costmodel.models import CostModels
from shard_ray.errors import InfeasibleError
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology
from shard_ray.policy.env import PlacementState
from shard_ray.policy.network import OptionScorer
from shard_ray.workload.tables import TableSpec

RESCUE_SAMPLES = 32


@torch.no_grad()
def roll_out(
    network: OptionScorer,
    tables: list[TableSpec],
    topology: Topology,
    models: CostModels,
    generator: torch.Generator | None = None,
) -> PlacementState | None:
    """One episode: the argmax option each step, or sampled ones with `generator`; None if stuck."""
    state = PlacementState(tables, topology, models)
    while not state.done:
        if state.stuck():
            return None
        obs = {k: torch.from_numpy(v).unsqueeze(0) for k, v in state.observation().items()}
        logits, _ = network(obs)
        if generator is None:
            slot = int(logits.argmax(dim=-1))
        else:
            slot = int(torch.multinomial(torch.softmax(logits[0], dim=-1), 1, generator=generator))
        state.take(slot)
    return state


def policy_placer(
    network: OptionScorer, models: CostModels, samples: int, seed: int
) -> Callable[[list[TableSpec], Topology], Plan]:
    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        generator = torch.Generator().manual_seed(seed)
        finished = [roll_out(network, tables, topology, models)]
        finished += [roll_out(network, tables, topology, models, generator) for _ in range(samples)]
        tries = 1 + samples
        # When memory is so tight that greedy decoding gets stuck, sampled plans may still fit.
        while all(s is None for s in finished) and tries < 1 + RESCUE_SAMPLES:
            finished.append(roll_out(network, tables, topology, models, generator))
            tries += 1
        done = [s for s in finished if s is not None]
        if not done:
            raise InfeasibleError(
                f"the policy found no placement within {topology.memory_gb:.3f} GB per device ({tries} tries); "
                "give more memory, or use cost_search, which also splits tables to fit them together"
            )
        return min(done, key=lambda s: s.cost).plan("dreamshard")

    return placer
