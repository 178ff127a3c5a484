"""DreamShard: a trained placement policy places tables one by one on the estimated MDP.

The policy (`shard_ray.policy`) was trained with RLlib's PPO on costs the cost models predict;
here it runs without Ray. Greedy decoding takes each table's most likely device; with
`samples` > 0 it also draws that many plans from the policy and keeps the one the cost models
price lowest. Should every one of them get stuck (a table fits on no device), it goes on
sampling, up to `RESCUE_SAMPLES` plans, until one fits.
"""

from __future__ import annotations

import torch

from shard_ray.costmodel.models import CostModels
from shard_ray.errors import ShardRayError
from shard_ray.placement.base import Placer, register
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import Topology
from shard_ray.policy.env import PlacementState
from shard_ray.policy.network import DeviceScorer, default_policy_path, load_policy
from shard_ray.workload.tables import TableSpec

RESCUE_SAMPLES = 32


@torch.no_grad()
def roll_out(
    network: DeviceScorer,
    tables: list[TableSpec],
    topology: Topology,
    models: CostModels,
    generator: torch.Generator | None = None,
) -> PlacementState | None:
    """One episode: the argmax device each step, or sampled ones with `generator`; None if stuck."""
    state = PlacementState(tables, topology, models)
    while not state.done:
        if state.stuck():
            return None
        obs = {k: torch.from_numpy(v).unsqueeze(0) for k, v in state.observation().items()}
        logits, _ = network(obs)
        if generator is None:
            device = int(logits.argmax(dim=-1))
        else:
            device = int(torch.multinomial(torch.softmax(logits[0], dim=-1), 1, generator=generator))
        state.place(device)
    return state


def policy_placer(network: DeviceScorer, models: CostModels, samples: int, seed: int) -> Placer:
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
            raise ShardRayError(
                f"the policy found no table-wise placement within {topology.memory_gb:.3f} GB per device "
                f"({tries} tries); give more memory or use a column-wise algorithm such as cost_search"
            )
        return min(done, key=lambda s: s.cost).plan("dreamshard")

    return placer


@register(
    "dreamshard",
    "rl",
    "DreamShard: an RLlib-trained policy places tables one by one on the cost model's estimated MDP",
    needs_cost_model=True,
    needs_policy=True,
)
def dreamshard(models: CostModels, policy: str | None = None, samples: int = 0, seed: int = 0) -> Placer:
    network, _ = load_policy(policy or default_policy_path())
    if samples < 0:
        raise ShardRayError(f"samples must be 0 or more, got {samples}")
    return policy_placer(network, models, samples, seed)
