"""The policy file, and scoring options with its weights without torch: what placing with a policy needs.

Training's network is `shard_ray.policy.network.OptionScorer` (torch); a file of its weights places tasks here in
numpy (`DecodingScorer`), so that `plan --algo dreamshard`, and `cost_search` starting from the policy, import no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from shard_ray.configfile import flags_of
from shard_ray.costmodel.models import (
    check_layers,
    default_cost_model_path,
    float32_state,
    linear_layers,
    softplus,
    state_of,
)
from shard_ray.errors import ShardRayError, first_line
from shard_ray.io import read_torch_file
from shard_ray.policy.env import NUM_CURRENT_FEATURES, NUM_OPTION_FEATURES, OPTION_FEATURES
from shard_ray.policy.settings import PolicyConfig

FORMAT = "shard-ray-policy/2"
# Policies of format 1 scored devices only, from fewer features: their weights do not fit this network.
UNSPLIT_FORMAT = "shard-ray-policy/1"
PRETRAINED_DIR = Path(__file__).parent / "pretrained"
DEFAULT_PRETRAINED = "cpu-reference.pt"
# A masked logit: finite, so an all-masked row (a terminal observation) gives no NaN.
MASKED_LOGIT = -1e9
PRIOR_FEATURES = [OPTION_FEATURES.index("makespan_increase"), OPTION_FEATURES.index("total_with_table")]
# Initial prior weights: a 0.1 x lower-bound increase of the plan's cost is 5 logits.
PRIOR_INIT = (50.0, 5.0)


# The settings that shape the network and its observations: a checkpoint of others does not load.
SHAPE_SETTINGS = ("hidden", "max_devices")
# The settings that draw and price the training tasks: resumed with others, training's returns and its held-out
# scores mix tasks of two kinds (a walk resumed 2-device training on 4 devices under other models, and policy.pt
# recorded the new models beside the first run's score).
TASK_SETTINGS = ("devices", "min_tables", "max_tables", "memory_headroom", "batch_size")


def default_policy_path() -> Path:
    """The policy shipped with the package, trained against the shipped CPU cost models."""
    return PRETRAINED_DIR / DEFAULT_PRETRAINED


@dataclass
class PolicyWeights:
    """A policy file's network: its width and weights (an `OptionScorer`'s state dict, as numpy arrays)."""

    path: Path
    hidden: int
    state: dict[str, np.ndarray]


class DecodingScorer:
    """`OptionScorer`'s option logits in numpy on its weights (a policy file's, `read_policy`), for placing a task: a
    step scores about 20 rows, where torch's dispatch and the value head, which placing does not need, took most of
    the time (docs/policy.md), and placing imports no torch. Training keeps the torch network; these logits agree
    with its to float32 rounding."""

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        self.embed = linear_layers(state, "embed_option.", depth=2)
        self.score = linear_layers(state, "score.", depth=2)
        self.prior = softplus(np.asarray(state["prior_weights"], dtype=np.float32))

    @classmethod
    def of_network(cls, network: Any) -> DecodingScorer:
        """The scorer of a torch `OptionScorer`'s weights as they are (training's network)."""
        return cls(state_of(network))

    def logits(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """Masked option logits [..., R] of an observation (`PlacementState.observation`), or of several stacked
        (`PlacementState.observe_wave`), as `OptionScorer.forward`."""
        options, table, valid = obs["options"], obs["table"], obs["valid"] > 0
        joined = np.concatenate(
            [options, np.broadcast_to(table[..., None, :], (*options.shape[:-1], table.shape[-1]))], axis=-1
        )
        h = _run_layers(joined, self.embed)
        count = valid.sum(axis=-1, keepdims=True)
        top = np.where(count > 0, np.where(valid[..., None], h, -np.inf).max(axis=-2), 0.0)
        mean = (h * valid[..., None]).sum(axis=-2) / np.maximum(count, 1)
        pooled = np.concatenate([top, mean], axis=-1).astype(h.dtype)
        context = np.broadcast_to(pooled[..., None, :], (*h.shape[:-1], pooled.shape[-1]))
        scores = _run_layers(np.concatenate([h, context], axis=-1), self.score)[..., 0]
        scores = scores - options[..., PRIOR_FEATURES] @ self.prior
        return np.where(obs["action_mask"] > 0, scores, np.float32(MASKED_LOGIT))


def _run_layers(rows: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """`rows` [..., F] through the layers, stacked rows as one matrix: numpy multiplies a stack [K, R, F] matrix by
    matrix, a wave's 32 observations of 16 options (`PlacementState.observe_wave`) at 2.2 ms against 1.1 as one."""
    shape = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1])
    for k, (weight, bias) in enumerate(layers):
        rows = rows @ weight + bias
        if k < len(layers) - 1:
            rows = np.tanh(rows)
    return rows.reshape(*shape, rows.shape[-1])


class PolicyInfo(BaseModel):
    """What a policy file says about its policy: the models it was trained against, its settings, how far it got.

    The file stores it as a plain mapping (`to_file`), so a file written before it was typed loads as it is:
    every field may be missing, and keys this version does not know are kept, not dropped."""

    model_config = ConfigDict(extra="allow")

    cost_model: str | None = None  # the models' file it was trained against, or shipped:NAME
    hardware: str | None = None  # those models' hardware
    config: dict[str, Any] = {}  # the PolicyConfig it was trained with (`shard_ray.policy.ppo`)
    pool_tables: int | None = None  # tables of the pool its episodes were drawn from
    loop: dict[str, Any] = {}  # the outer loop's settings, for a policy `policy outer-loop` trained
    iterations: int | None = None  # PPO iterations done
    # The held-out check that chose the network the file holds (`shard_ray.policy.ppo.HeldOut.record`): how many
    # tasks and their seed, the iteration training started from and its score, the kept network's score and iteration.
    validation: dict[str, Any] = {}

    def to_file(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True, exclude_none=True)

    def network_kept(self) -> str:
        """Which network the file holds, as training's held-out check chose it (empty where the file says nothing)."""
        done = f"{self.iterations} PPO iteration{'s' if self.iterations != 1 else ''}" if self.iterations else ""
        record = self.validation
        if not record or "iteration" not in record:
            return done
        if record["iteration"] == record.get("start", 0):
            start = (
                "the untrained network" if record["iteration"] == 0 else f"iteration {record['iteration']}'s network"
            )
            return f"{start}, which its held-out check kept over {done or 'training'} (none priced its tasks lower)"
        gain = 1 - record["score"] / record["prior"]
        return (
            f"iteration {record['iteration']} of {done or 'training'}, {gain:.2%} below its start on its held-out tasks"
        )


def read_policy(path: str | os.PathLike[str]) -> tuple[PolicyWeights, PolicyInfo]:
    """A policy file, or a `policy train` output folder holding `policy.pt`: its network's weights and what it says,
    read without torch (`read_torch_file`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "policy.pt"
    if not path.is_file():
        beside = path.parent.parent / "policy.pt"  # a training folder's checkpoint/ named for the folder
        below = sorted(path.parent.glob("*/policy.pt")) if path.parent.is_dir() else []  # a folder of trainings
        hint = ""
        if path.parent.name == "checkpoint" and beside.is_file():
            hint = f"; the training folder's policy file is {beside}"
        elif below:
            hint = f"; the training folders in {path.parent} hold {', '.join(map(str, below[:3]))}"
            hint += f" and {len(below) - 3} more" if len(below) > 3 else ""
        raise ShardRayError(f"policy file not found: {path}{hint}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ShardRayError(f"cannot read policy file {path}: {first_line(err)}") from err
    written_by = "`policy train` writes policy.pt"
    blob = read_torch_file(data, str(path), "policy", "a shard-ray policy", FORMAT, written_by, UNSPLIT_FORMAT)
    if blob["format"] == UNSPLIT_FORMAT:
        raise ShardRayError(
            f"policy file {path} is of an earlier release ({UNSPLIT_FORMAT}: it places tables whole only); train one "
            "for this release with `shard-ray policy train`, or leave --policy out for the shipped one"
        )
    try:
        weights = PolicyWeights(path, int(blob["hidden"]), float32_state(blob["state"]))
        _check_shapes(weights)
        info = PolicyInfo.model_validate(blob.get("info", {}))
    except (KeyError, TypeError, ValueError, AttributeError, ValidationError) as err:
        raise ShardRayError(f"policy file {path} is damaged: {first_line(err)}") from err
    return weights, info


def _check_shapes(weights: PolicyWeights) -> None:
    """Raises KeyError or ValueError where the file lacks a weight placing needs or has one of another shape."""
    h = weights.hidden
    scorer = DecodingScorer(weights.state)
    check_layers(scorer.embed, NUM_OPTION_FEATURES + NUM_CURRENT_FEATURES, h, h)
    check_layers(scorer.score, 3 * h, h, 1)
    if scorer.prior.shape != (len(PRIOR_FEATURES),):
        raise ValueError(f"prior weights of shape {scorer.prior.shape}")


def models_label(cost_model: str | None) -> str:
    """How a policy file names the models it is trained against: shipped:NAME for the shipped file, else the file's
    absolute path (as given, a relative one named another file from another folder)."""
    shipped = default_cost_model_path()
    given = Path(cost_model).resolve() if cost_model else shipped.resolve()
    return f"shipped:{shipped.name}" if given == shipped.resolve() else str(given)


def nothing_to_train(done: int, asked: int) -> str:
    """What resuming a training of `done` iterations says where `asked` are no more."""
    return (
        f"nothing to train: {done} iterations done, --iterations {asked} asked for in all; give more to train further"
    )


def refuse_other_training(
    checkpoint_dir: Path,
    given: Mapping[str, Any],
    models: str | None = None,
    pool_tables: int | None = None,
    failed: bool = False,
) -> None:
    """Refuse to resume training from `checkpoint_dir` with the settings `given` where the policy file beside it
    records other `SHAPE_SETTINGS` (the checkpoint's network would not load into theirs) or `TASK_SETTINGS`, other
    `models` (`models_label`'s; None: not checked, as the outer loop's change each round) or a pool of other
    `pool_tables`, naming them as flags; where the checkpoint `failed` to load, refuse whatever the file says. Read
    without torch, so a command refuses before Ray starts."""
    try:
        info = read_policy(checkpoint_dir.parent / "policy.pt")[1]
    except ShardRayError:
        info = PolicyInfo()
    recorded, flags = info.config, flags_of(PolicyConfig)

    def same(a: Any, b: Any) -> bool:  # JSON keeps a tuple as a list
        return (tuple(a) if isinstance(a, list | tuple) else a) == (tuple(b) if isinstance(b, list | tuple) else b)

    def shown(value: Any) -> str:
        return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)

    differ = [
        (flags.get(name, name), shown(recorded[name]), shown(given[name]))
        for name in (*SHAPE_SETTINGS, *TASK_SETTINGS)
        if name in recorded and name in given and not same(recorded[name], given[name])
    ]
    # a file of an earlier release recorded the path as given: read from here, as the command that wrote it ran
    recorded_models = info.cost_model
    if recorded_models is not None and not recorded_models.startswith("shipped:"):
        recorded_models = models_label(recorded_models)
    if models is not None and recorded_models is not None and recorded_models != models:
        differ.append(("--cost-model", info.cost_model, models))
    if pool_tables is not None and info.pool_tables is not None and info.pool_tables != pool_tables:
        differ.append(("--tables", f"a pool of {info.pool_tables} tables", f"one of {pool_tables}"))
    if not differ and not failed:
        return
    shapes = " or ".join(flags[name] for name in SHAPE_SETTINGS)
    found = (
        "; ".join(f"{flag} {there} there, {here} here" for flag, there, here in differ)
        if differ
        else f"another network shape: {shapes}"
    )
    raise ShardRayError(
        f"the checkpoint in {checkpoint_dir} was trained with other settings ({found}): resume it with the settings "
        "it was made with (its policy.pt records them), or train into a new --out"
    )
