"""Every sharding type against table/column-wise only and TorchRec's plan: measured on the gang, simulated at 8-64 devices.

    python experiments/sharding_types.py --out shard-ray-out/sharding_types

Tasks, public shapes in the minimal table format (`experiments/tables/`), sized so that a few
tables dominate:

- criteo_100m: Criteo Kaggle's 26 cardinalities at dim 64, its largest (cat_2) grown to 100M rows
  (25.6 GB), on devices of --criteo-memory-gb: cat_2 fits no device whole.
- mlperf_dcnv2: MLPerf DLRM-DCNv2's 26 multi-hot tables (Criteo 1TB cardinalities, dim 128,
  pooling factors 1 to 100), on devices of --mlperf-memory-gb.

Plans, as `place` makes them: cost_search with its default types (table-, column-, row-wise);
cost_search_dp, data-parallel allowed too; cost_search_tw_cw, limited to table- and column-wise
by a constraints object forbidding row_wise and data_parallel for every table (the best
table/column-wise plan the search finds); TorchRec's planner, free to choose any type; and
size_lookup_greedy. On the --devices gang, every plan is measured in --rounds interleaved rounds
(medians, 95% CIs; the every-type plan's ratio to each other plan per round, its median and CI).
Then each algorithm plans the task at 8 to 64 devices (memory --memory-headroom times an even
split), simulated by the cost models. Writes `sharding_types.json` and `.md` to --out.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shard_ray.arguments import Parser
from shard_ray.cli.flags import add_settings, settings_from
from shard_ray.configfile import setting
from shard_ray.costmodel.bounds import lower_bound_ms
from shard_ray.costmodel.models import CostModels, default_cost_model_path
from shard_ray.costmodel.simulator import Simulator, price_comm
from shard_ray.errors import InfeasibleError
from shard_ray.io import write_json
from shard_ray.placement import place
from shard_ray.plan.constraints import Constraints, TableConstraint
from shard_ray.plan.cost import RoundsSummary
from shard_ray.plan.piece import SHARDING_TYPES
from shard_ray.plan.plan import Plan
from shard_ray.plan.topology import GB, Topology, shard_bytes
from shard_ray.profiling.procedure import MeasureConfig
from shard_ray.workload.tables import TableSpec, load_tables

TABLES = Path(__file__).parent / "tables"
ALGORITHMS = ("cost_search", "cost_search_dp", "cost_search_tw_cw", "torchrec", "size_lookup_greedy")


@dataclass(frozen=True)
class ShardingTypesBenchmark:
    out: str = setting("shard-ray-out/sharding_types", "folder of the results")
    devices: int = setting(2, "devices of the gang", min=2)
    rounds: int = setting(15, "interleaved rounds per plan on the gang", min=1)
    criteo_memory_gb: float = setting(18.0, "criteo_100m: memory per gang device, GiB", min=0.1)
    mlperf_memory_gb: float = setting(64.0, "mlperf_dcnv2: memory per gang device, GiB", min=0.1)
    simulated_devices: tuple[int, ...] = setting((8, 16, 32, 64), "device counts to simulate", repeat=True)
    memory_headroom: float = setting(1.5, "simulated: memory per device over an even split of the tables", min=1)


def tasks() -> dict[str, list[TableSpec]]:
    criteo = [
        t.model_copy(update={"dim": 64, "rows": 100_000_000 if t.name == "cat_2" else t.rows})
        for t in load_tables(TABLES / "criteo_kaggle.json")
    ]
    return {"criteo_100m": criteo, "mlperf_dcnv2": load_tables(TABLES / "mlperf_dlrm_dcnv2.json")}


def plan_with(algorithm: str, tables: list[TableSpec], topology: Topology) -> Plan:
    if algorithm == "cost_search_dp":  # data-parallel allowed too
        plan = place("cost_search", tables, topology, settings={"sharding_types": list(SHARDING_TYPES)})
        return plan.model_copy(update={"algorithm": algorithm})
    if algorithm == "cost_search_tw_cw":
        only = TableConstraint(not_types=["row_wise", "data_parallel"])
        constraints = Constraints(tables={t.name: only for t in tables})
        plan = place("cost_search", tables, topology, constraints=constraints)
        return plan.model_copy(update={"algorithm": algorithm})
    return place(algorithm, tables, topology)


def types_of(plan: Plan, tables: list[TableSpec]) -> dict[str, int]:
    return dict(Counter(sharding.type for sharding in plan.table_shardings(tables).values()))


def ratio_summary(mine: list[float], other: list[float]) -> RoundsSummary:
    """The every-type plan's cost over another's, round by round (they ran side by side in each round)."""
    return RoundsSummary.of([a / b for a, b in zip(mine, other)])


def measured(name: str, tables: list[TableSpec], memory_gb: float, config: ShardingTypesBenchmark) -> dict[str, Any]:
    from shard_ray.profiling.gang import DeviceGang

    topology = Topology(num_devices=config.devices, memory_bytes=int(memory_gb * GB))
    plans, record = [], {"memory_gb": memory_gb, "plans": {}}
    for algorithm in ALGORITHMS:
        try:
            plan = plan_with(algorithm, tables, topology)
        except InfeasibleError as err:
            record["plans"][algorithm] = {"infeasible": str(err)}
            print(f"{name}: {algorithm}: no plan ({err})", flush=True)
            continue
        plans.append(plan)
        record["plans"][algorithm] = {"types": types_of(plan, tables)}
    with DeviceGang(config.devices, comm_pricer=price_comm) as gang:
        costs = gang.evaluate_rounds(plans, tables, MeasureConfig.for_topology(topology), rounds=config.rounds)
    rounds = {}
    for plan, cost in zip(plans, costs):
        summary = cost.rounds or RoundsSummary.of([cost.cost_ms])
        rounds[plan.algorithm] = summary.rounds_ms
        record["plans"][plan.algorithm].update(measured=summary.model_dump(), parts=cost.model_dump()["devices"])
    for other in rounds:
        if other != "cost_search" and "cost_search" in rounds:
            ratio = ratio_summary(rounds["cost_search"], rounds[other])
            record["plans"][other]["cost_search_over_this"] = ratio.model_dump()
    return record


def simulated(tables: list[TableSpec], config: ShardingTypesBenchmark) -> dict[str, Any]:
    """Every algorithm's plan at each device count, priced by the shipped models (whoever made it)."""
    models = CostModels.load(default_cost_model_path())
    results: dict[str, Any] = {}
    for devices in config.simulated_devices:
        # headroom over an even split, never raised to the largest table: those stay too large for a device
        memory = int(config.memory_headroom * sum(shard_bytes(t, t.dim, "rowwise_adagrad") for t in tables) / devices)
        topology = Topology(num_devices=devices, memory_bytes=memory)
        row: dict[str, Any] = {"memory_gb": memory / GB}
        for algorithm in ALGORITHMS:
            try:
                plan = plan_with(algorithm, tables, topology)
            except InfeasibleError as err:
                row[algorithm] = {"infeasible": str(err)}
                continue
            row[algorithm] = {
                "simulated_ms": Simulator(models).plan_cost(plan, tables, topology.batch_size).cost_ms,
                "placement_seconds": plan.placement_seconds,
                "types": types_of(plan, tables),
            }
        row["lower_bound_ms"] = lower_bound_ms(models, tables, topology)
        results[str(devices)] = row
        print(f"simulated {devices} devices: {row}", flush=True)
    return results


def markdown(results: dict[str, Any], config: ShardingTypesBenchmark) -> str:
    lines = [
        f"Measured on the {config.devices}-device gang, {config.rounds} interleaved rounds (median ms, 95% CI; "
        "cost_search / other: the ratio per round, its median and CI):",
        "",
        "| task | plan | types | median ms | 95% CI | cost_search / this |",
        "|---|---|---|---:|---|---|",
    ]
    for task, r in results.items():
        for algorithm, p in r["measured"]["plans"].items():
            if "infeasible" in p:
                lines.append(f"| {task} | {algorithm} | no plan | | | |")
                continue
            m = p["measured"]
            ratio = p.get("cost_search_over_this")
            ratio_text = (
                f"{ratio['median_ms']:.3f} [{ratio['ci_low_ms']:.3f}, {ratio['ci_high_ms']:.3f}]" if ratio else ""
            )
            types = ", ".join(f"{k} {v}" for k, v in sorted(p["types"].items()))
            lines.append(
                f"| {task} | {algorithm} | {types} | {m['median_ms']:.2f} | [{m['ci_low_ms']:.2f}, {m['ci_high_ms']:.2f}] | {ratio_text} |"
            )
    lines += ["", "Simulated by the shipped cost models (ms; — no plan within memory):", ""]
    header = "| task | devices | GB/device | " + " | ".join(ALGORITHMS) + " | lower bound |"
    lines += [header, "|---|---:|---:|" + "---:|" * (len(ALGORITHMS) + 1)]
    for task, r in results.items():
        for devices, row in r["simulated"].items():
            cells = [f"{row[a]['simulated_ms']:.3f}" if "simulated_ms" in row[a] else "—" for a in ALGORITHMS]
            lines.append(
                f"| {task} | {devices} | {row['memory_gb']:.2f} | "
                + " | ".join(cells)
                + f" | {row['lower_bound_ms']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import ray

    from shard_ray.runtime import dashboard_agent_on_any_port

    parser = Parser(description=__doc__.split("\n\n")[0])
    add_settings(parser, ShardingTypesBenchmark)
    config = settings_from(ShardingTypesBenchmark, parser.parse_args(argv))
    out = Path(config.out)
    with dashboard_agent_on_any_port():
        ray.init(address="local", num_cpus=config.devices, include_dashboard=False, log_to_driver=False)
    memory = {"criteo_100m": config.criteo_memory_gb, "mlperf_dcnv2": config.mlperf_memory_gb}
    results = {}
    for name, tables in tasks().items():
        results[name] = {
            "measured": measured(name, tables, memory[name], config),
            "simulated": simulated(tables, config),
        }
        write_json(out / "sharding_types.json", results)
    (out / "sharding_types.md").write_text(markdown(results, config))
    print(markdown(results, config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
