"""Placing a task with a trained policy: greedy decoding, sampling, and rescue sampling.

Greedy decoding takes each step's most likely option (the first of a tie); with `samples` > 0 it
also draws that many plans from the policy and keeps the one the cost models price lowest. Should every one of
them get stuck (a table fits on no device), it goes on sampling, up to `RESCUE_SAMPLES` plans,
until one fits. No Ray: the policy runs in the caller's process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from shard_ray.costmodel.bounds import LowerBound
from shard_ray.costmodel.bounds import lower_bound as task_lower_bound
from shard_ray.costmodel.models import CostModels
from shard_ray.errors import InfeasibleError
from shard_ray.plan.plan import Plan, SearchReport
from shard_ray.plan.topology import Topology, format_gb
from shard_ray.policy.env import PlacementState
from shard_ray.policy.policy_file import DecodingScorer
from shard_ray.workload.tables import TableSpec

RESCUE_SAMPLES = 32
# Options whose logits are closer than this are a tie, taken in the options' order (devices by index): like devices
# score alike but for float rounding, which numpy's products and torch's round differently.
TIE_LOGITS = 1e-3


def best_option(logits: np.ndarray) -> int:
    """Greedy decoding's choice: the first option within `TIE_LOGITS` of the highest logit."""
    return int(np.flatnonzero(logits >= logits.max() - TIE_LOGITS)[0])


def roll_out(
    scorer: DecodingScorer,
    tables: list[TableSpec],
    topology: Topology,
    models: CostModels,
    generator: np.random.Generator | None = None,
    lower_bound: LowerBound | None = None,
) -> PlacementState:
    """One episode: the best option each step (`best_option`), or sampled ones with `generator`; it ends where the next
    piece fits nowhere (`PlacementState.stuck`), its state then not `done`. `lower_bound`: the task's, where the caller
    has it."""
    return play_on(scorer, PlacementState(tables, topology, models, lower_bound=lower_bound), generator)


def play_on(
    scorer: DecodingScorer, state: PlacementState, generator: np.random.Generator | None = None
) -> PlacementState:
    """`state` played to its end as `roll_out` plays a new one (from a partial plan: an experiment's rollouts)."""

    def choose(logits: np.ndarray) -> np.ndarray:
        """Each row's option [K] of `logits` [K, R]: the best, or drawn from their softmax (the Gumbel-max draw: the
        largest of the logits each plus a Gumbel variate; masked options, at MASKED_LOGIT, are never drawn)."""
        if generator is None:
            return np.array([best_option(row) for row in logits])
        return np.argmax(logits + generator.gumbel(size=logits.shape), axis=-1)

    while not state.done:
        wave = state.wave()
        if wave:
            candidates, observations = state.observe_wave(wave)
            if len(candidates):
                state.place_wave(choose(scorer.logits(observations)))
                continue
        if state.stuck():
            return state
        state.take(int(choose(scorer.logits(state.observation())[None])[0]))
    return state


def policy_placer(
    scorer: DecodingScorer,
    models: CostModels,
    samples: int,
    seed: int,
    lower_bound: Callable[[list[TableSpec], Topology], LowerBound] | None = None,
) -> Callable[[list[TableSpec], Topology], Plan]:
    """Greedy decoding and `samples` sampled plans, the best kept; `lower_bound` gives a task's (`lower_bound` under
    `models`), computed once for all of them: by default, here."""

    def placer(tables: list[TableSpec], topology: Topology) -> Plan:
        generator = np.random.default_rng(seed)
        bound = (lower_bound or partial(task_lower_bound, models))(tables, topology)
        finished = [roll_out(scorer, tables, topology, models, lower_bound=bound)]
        finished += [roll_out(scorer, tables, topology, models, generator, bound) for _ in range(samples)]
        tries = 1 + samples
        # When memory is so tight that greedy decoding gets stuck, sampled plans may still fit.
        while not any(s.done for s in finished) and tries < 1 + RESCUE_SAMPLES:
            finished.append(roll_out(scorer, tables, topology, models, generator, bound))
            tries += 1
        done = [s for s in finished if s.done]
        if not done:
            rescue = tries - 1 - samples
            raise InfeasibleError(
                f"the policy found no placement within {format_gb(topology.memory_bytes)} per device: greedy decoding and "
                f"{tries - 1} sampled plans ({rescue} drawn because every plan before got stuck) each left a piece that "
                "fit nowhere; give more memory, or use cost_search, which also splits tables to fit them together"
            )
        kept = min(done, key=lambda s: s.cost)
        plan = kept.plan("dreamshard")
        if len(finished) == 1:
            return plan
        return plan.model_copy(update={"search": SearchReport(sampled=sampling_report(finished, kept))})

    return placer


def sampling_report(finished: list[PlacementState], kept: PlacementState) -> str:
    """One line on a placing that sampled: greedy decoding's plan (`finished[0]`), the sampled plans, which was kept."""
    greedy, drawn = finished[0], finished[1:]
    stuck = sum(not s.done for s in drawn)
    line = f"sampled {len(drawn)} plan{'s' if len(drawn) != 1 else ''} from the policy" + (
        f" ({stuck} got stuck: a piece fit nowhere)" if stuck else ""
    )
    if not greedy.done:
        return f"{line}; greedy decoding got stuck: kept sampled plan {finished.index(kept)}, {kept.cost:.3f} ms"
    if kept is greedy:
        return f"{line}; none priced below greedy decoding's {greedy.cost:.3f} ms, which was kept"
    best = f"kept sampled plan {finished.index(kept)}, {kept.cost:.3f} ms"
    return f"{line}; {best}, against greedy decoding's {greedy.cost:.3f} ms"
