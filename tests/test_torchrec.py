"""TorchRec for real: its planner as a baseline, and exported plans driving DistributedModelParallel on 2 gloo ranks."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from shard_ray.cli import main
from shard_ray.errors import ShardRayError
from shard_ray.interop.torchrec import export_plan, sharding_plan
from shard_ray.placement import place
from shard_ray.plan.piece import TablePiece, row_wise, table_row_wise
from shard_ray.plan.plan import Plan, PlanSettings, Shard, load_plan, save_plan
from shard_ray.plan.topology import GB, Topology, memory_cap_with_headroom
from shard_ray.workload.synthetic import PoolConfig, generate_pool
from shard_ray.workload.tables import TableSpec, save_tables

BATCH = 8  # shard_ray.interop.torchrec_step's samples per rank
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_torchrec_planner_plans_the_task_within_memory(devices):
    tables = generate_pool(PoolConfig(num_tables=24, seed=2))
    topology = Topology(
        num_devices=devices, memory_bytes=memory_cap_with_headroom(tables, devices, 1.5), batch_size=1024
    )
    plan = place("torchrec", tables, topology)  # place() checks coverage and memory under shard-ray's model
    assert plan.algorithm == "torchrec" and plan.num_devices == devices
    assert {s.table for s in plan.shards} == {t.name for t in tables}
    assert len({s.device for s in plan.shards}) > 1  # it spreads the load


def test_torchrec_planner_refuses_what_does_not_fit():
    tables = [TableSpec(name="big", rows=10_000_000, dim=128, pooling_factor=1.0)]
    with pytest.raises(ShardRayError, match="TorchRec's planner found no plan") as refused:
        place("torchrec", tables, Topology(num_devices=2, memory_bytes=GB // 4, batch_size=1024))
    # which table does not fit, and by how much, by shard-ray's memory model
    assert "table 'big' needs 4.81 GiB" in str(refused.value) and "over the cap of 0.25 GiB" in str(refused.value)
    assert str(refused.value) == str(refused.value).strip()


def _uneven_plan(tables: list[TableSpec], widest: TableSpec, replicated: TableSpec) -> Plan:
    """A hand-made plan with uneven column slices of `widest`, rank 0 holding two of them, and `replicated`
    data-parallel (TorchRec runs these types on CPU; it refuses row-wise there)."""
    d = widest.dim
    shards = [
        Shard(table=t.name, device=i % 2, columns=(0, t.dim))
        for i, t in enumerate(tables)
        if t is not widest and t is not replicated
    ]
    shards += [Shard(table=replicated.name, device=r, columns=(0, replicated.dim), replicated=True) for r in (0, 1)]
    shards += [
        Shard(table=widest.name, device=0, columns=(0, d // 4)),
        Shard(table=widest.name, device=1, columns=(d // 4, d // 2)),
        Shard(table=widest.name, device=0, columns=(d // 2, d)),
    ]
    return Plan(num_devices=2, algorithm="manual", shards=shards)


@pytest.mark.slow
def test_torchrec_estimator_prices_a_table_wise_tables_all_to_alls_by_its_bytes_over_the_link():
    """TorchRec's estimator's price of each table placed table-wise (what experiments/comm_over_hosts.py sets
    beside the measurements): twice the columns, twice the forward and backward; a link 10x slower between hosts,
    10x the price; the ids of its input distribution grow with the pooling factor, not the columns."""
    from shard_ray.interop.torchrec import torchrec_table_wise_comms

    tables = [
        TableSpec(name="narrow", rows=10_000, dim=32, pooling_factor=2.0),
        TableSpec(name="wide", rows=10_000, dim=64, pooling_factor=2.0),
        TableSpec(name="long", rows=10_000, dim=32, pooling_factor=8.0),
    ]
    over = {
        gbps: torchrec_table_wise_comms(
            tables, Topology(num_devices=4, memory_bytes=GB, batch_size=1024, devices_per_host=2, inter_host_gbps=gbps)
        )
        for gbps in (0.03, 0.003)
    }
    fast, slow = over[0.03], over[0.003]
    assert set(fast) == {"narrow", "wide", "long"}
    for k in (1, 2):  # forward, backward
        assert fast["wide"][k] == pytest.approx(2 * fast["narrow"][k]) and fast["long"][k] == fast["narrow"][k]
        assert slow["narrow"][k] == pytest.approx(10 * fast["narrow"][k])
    assert fast["long"][0] > fast["narrow"][0] == fast["wide"][0] > 0


@pytest.mark.slow  # a training step of gloo ranks: 13-16 s of `make test-fast`'s 93
def test_exported_plan_drives_distributed_model_parallel(tmp_path, capsys):
    tables = generate_pool(PoolConfig(num_tables=8, seed=11))
    tables = [
        t.model_copy(update={"rows": min(t.rows, 5000)}) for t in tables
    ]  # small tables: this checks the plan, not speed
    tables_file, plan_file, export_file = tmp_path / "tables.json", tmp_path / "plan.json", tmp_path / "torchrec.json"
    save_tables(tables_file, tables)
    widest = max(tables, key=lambda t: t.dim)
    replicated = next(t for t in tables if t is not widest)
    plan_file.write_text(_uneven_plan(tables, widest, replicated).model_dump_json())
    assert (
        main(
            [
                "export",
                "--plan",
                str(plan_file),
                "--tables",
                str(tables_file),
                "--device",
                "cpu",
                "--out",
                str(export_file),
            ]
        )
        == 0
    )
    assert f"(1 column-wise, 1 data-parallel, {len(tables) - 2} table-wise)" in capsys.readouterr().out
    exported = json.loads(export_file.read_text())
    assert exported["tables"][widest.name]["ranks"] == [0, 1, 0]

    # one step under DistributedModelParallel, as the own-tables guide runs it
    step = subprocess.run(
        [sys.executable, "-m", "shard_ray.interop.torchrec_step", "--tables", str(tables_file), "--plan", str(export_file)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert step.returncode == 0, step.stderr
    results = {int(rank): result for rank, result in json.loads(step.stdout.strip().splitlines()[-1]).items()}
    assert (
        step.stdout.startswith("one training step on 2 gloo ranks")
        and "\nrank 0: holds " in step.stdout
        and "SGD updated its shards: yes" in step.stdout
    )
    total_dim = sum(t.dim for t in tables)
    plan = load_plan(plan_file)
    for rank in (0, 1):
        assert results[rank]["shape"] == [BATCH, total_dim]  # each rank gets every table's pooled vectors for its batch
        # the backward reached every table the rank holds a shard of, and SGD changed it
        assert results[rank]["updated"] == sorted(t for t, shards in results[rank]["local_shards"].items() if shards)
        held = sorted(
            (name, o[1], o[1] + o[3]) for name, shards in results[rank]["local_shards"].items() for o in shards
        )
        assert held == sorted(
            (s.table, s.columns[0], s.columns[1]) for s in plan.shards if s.device == rank and not s.replicated
        )
        assert results[rank]["replicas"] == {replicated.name: True}  # the gradient reached its replica


def test_the_steps_checksum_of_a_shard_takes_no_copy_of_it():
    """Each rank sums its shards before and after the step to see SGD reach them; summed whole in float64, torch
    copied a shard to float64 first, twice its bytes again (a rank holding a 50M-row table whole was killed for
    memory). Here a 256 MB shard: its sum equals the whole float64 sum, and the process's peak grows by little."""
    probe = """
import resource, torch
from shard_ray.interop.torchrec_step import _checksum
shard = torch.rand(1_000_000, 64, generator=torch.Generator().manual_seed(0))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
total = _checksum(shard)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(total, float(shard.double().sum()), grown * 1024)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    total, exact, grown = map(float, done.stdout.split())
    assert total == pytest.approx(exact, rel=1e-12)
    assert grown < 64 * 1024**2, f"the checksum grew the process by {grown / 1024**2:.0f} MB"


def test_the_steps_memory_refusal_names_the_share_of_available_memory_it_allows(tmp_path, capsys):
    """Weights of 90% of the available memory are refused naming the 80% the step allows them: the refusal named
    weights below what was available, and read as a contradiction (a walk). Refused before any rank starts."""
    from shard_ray.interop.torchrec_step import WEIGHTS_SHARE, _available_memory, run

    rows = int(0.9 * _available_memory() / (64 * 4))
    tables = [TableSpec(name="huge", rows=rows, dim=64, pooling_factor=1.0)]
    save_tables(tmp_path / "t.json", tables)
    save_plan(tmp_path / "p.json", Plan.from_assignment([TablePiece.whole(tables[0])], [0], 2, "x"))
    argv = ["export", "--plan", str(tmp_path / "p.json"), "--tables", str(tmp_path / "t.json"), "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "e.json")]) == 0
    with pytest.raises(ShardRayError, match=rf"more than {WEIGHTS_SHARE:.0%} of the [\d.]+ GiB this machine has "):
        run(str(tmp_path / "t.json"), str(tmp_path / "e.json"), batch=8)


def test_row_wise_export_is_torchrec_own_layout(tmp_path):
    """TorchRec refuses row-wise on CPU, so its export is checked against TorchRec's own
    calculate_shard_sizes_and_offsets and turned into TorchRec's ShardingPlan objects."""
    from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets

    tables = [
        TableSpec(name="big", rows=1_000_003, dim=16, pooling_factor=2.0),
        TableSpec(name="few", rows=5, dim=8, pooling_factor=1.0),
    ]
    # Row-wise over 4 ranks, and table-row-wise over host 1 of two hosts of 4: TorchRec's blocks over
    # the (local) world, on its ranks.
    layouts = [
        ("row_wise", 4, 4, [p for t in tables for p in row_wise(t, 4)], [0, 1, 2, 3]),
        ("table_row_wise", 8, 4, [p for t in tables for p in table_row_wise(t, 4, 1)], [4, 5, 6, 7]),
    ]
    exported = {}
    for kind, world, local, pieces, ranks in layouts:
        plan = Plan.from_assignment(pieces, [p.devices[0] for p in pieces], world, kind)
        plan.settings = PlanSettings(memory_gb=1, batch_size=512, optimizer="sgd", devices_per_host=local)
        exported[kind] = export_plan(plan, tables)
        for table in tables:
            sizes, offsets = calculate_shard_sizes_and_offsets(
                torch.empty(table.rows, table.dim, device="meta"), world, local, kind
            )
            mine = exported[kind].tables[table.name]
            assert mine.sharding_type == kind and mine.ranks == ranks
            assert [list(s.sizes) for s in mine.shards] == sizes and [list(s.offsets) for s in mine.shards] == offsets
    few = sharding_plan(exported["row_wise"]).plan[""]["few"]
    assert [m.shard_sizes for m in few.sharding_spec.shards] == [[2, 8], [2, 8], [1, 8], [0, 8]]
    few = sharding_plan(exported["table_row_wise"]).plan[""]["few"]
    assert [m.placement.device().index for m in few.sharding_spec.shards] == [0, 1, 2, 3]  # rank r on cuda:(r mod 4)
    # Row ranges TorchRec's input distribution cannot run are refused by name.
    uneven = Plan(num_devices=2, algorithm="x", shards=[
        Shard(table="few", device=0, columns=(0, 8), rows=(0, 1)), Shard(table="few", device=1, columns=(0, 8), rows=(1, 5)),
        Shard(table="big", device=0, columns=(0, 16)),
    ])  # fmt: skip
    with pytest.raises(ShardRayError, match="table 'few''s row shards are not TorchRec's row-wise layout"):
        export_plan(uneven, tables)


def test_export_for_cpu_ranks_refuses_row_wise_tables_and_writes_nothing(tmp_path, capsys):
    """TorchRec's CPU ranks run no row-wise table: `export --device cpu` says so when it exports, in a line, where
    the ranks would otherwise fail at their first step (`torchrec_step` said so only when it ran them)."""
    tables = [
        TableSpec(name="big", rows=1_000_003, dim=16, pooling_factor=2.0),
        TableSpec(name="few", rows=5, dim=8, pooling_factor=1.0),
    ]
    pieces = row_wise(tables[0], 2) + [TablePiece.whole(tables[1])]
    plan = Plan.from_assignment(pieces, [0, 1, 0], 2, "row_wise")
    plan_file, tables_file, out = tmp_path / "plan.json", tmp_path / "tables.json", tmp_path / "cpu.json"
    save_plan(plan_file, plan)
    save_tables(tables_file, tables)
    argv = ["export", "--plan", str(plan_file), "--tables", str(tables_file), "--out", str(out)]
    assert main([*argv, "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "TorchRec runs row-wise shards on GPUs only, and this plan has them: big" in line and not out.exists()
    assert main(argv) == 0 and json.loads(out.read_text())["tables"]["big"]["sharding_type"] == "row_wise"
    # named .yaml, written as YAML, as every file the commands write and read (it was JSON under any name)
    from shard_ray.interop.torchrec import load_export

    written = tmp_path / "exported.yaml"
    assert main([*argv[:-1], str(written)]) == 0 and not written.read_text().startswith("{")
    assert load_export(written) == load_export(out)
    with pytest.raises(SystemExit, match="2"):  # a name of no format it writes: refused as the flag is read
        main([*argv[:-1], str(tmp_path / "exported.txt")])
    assert not (tmp_path / "exported.txt").exists() and ".json, .yaml or .yml" in capsys.readouterr().err
    # the constraint the line gives, in a constraints file, plans the tables so that CPU ranks take them
    suggested = line.split("`not_types: [")[1].split("]`")[0].split(", ")
    assert suggested == ["row_wise"]
    constraints = tmp_path / "cpu.yaml"
    constraints.write_text(yaml.safe_dump({"tables": {"big": {"not_types": suggested}}}))
    flags = ["--tables", str(tables_file), "--devices", "2", "--memory-gb", "0.0625", "--algo", "cost_search"]
    assert main(["plan", *flags, "--constraints", str(constraints), "--out", str(plan_file)]) == 0
    assert main([*argv, "--device", "cpu"]) == 0
    assert {t["sharding_type"] for t in json.loads(out.read_text())["tables"].values()} <= {"table_wise", "column_wise"}


def test_a_plan_measured_on_cpu_devices_that_splits_by_rows_is_said_to_be_no_plan_for_cpu_ranks():
    """`plan --measure` on CPU devices may keep a plan that splits tables by rows (TorchRec's own, in a walk), which
    `export --device cpu` then refuses: the command says so when it writes the plan, naming the tables; measured on
    GPUs, or not measured, it says nothing."""
    from shard_ray.cli.planning import _rows_on_cpu_note
    from shard_ray.plan.cost import MeasuredComparison

    tables = [
        TableSpec(name="big", rows=1_000_003, dim=16, pooling_factor=2.0),
        TableSpec(name="few", rows=5, dim=8, pooling_factor=1.0),
    ]
    plan = Plan.from_assignment(row_wise(tables[0], 2) + [TablePiece.whole(tables[1])], [0, 1, 0], 2, "torchrec")

    def measured_on(hardware: str) -> Plan:
        return plan.model_copy(update={"measured": MeasuredComparison.model_construct(hardware=hardware)})

    note = _rows_on_cpu_note(measured_on("cpu:AMD EPYC:1thread"), tables)
    assert note.startswith("note: measured on CPU devices, this plan splits big by rows") and "few" not in note
    assert "`not_types: [row_wise]`" in note
    assert _rows_on_cpu_note(measured_on("cuda:NVIDIA H100 80GB HBM3"), tables) is None
    assert _rows_on_cpu_note(plan, tables) is None
    whole = Plan.from_assignment([TablePiece.whole(t) for t in tables], [0, 1], 2, "x")
    assert _rows_on_cpu_note(whole.model_copy(update={"measured": measured_on("cpu:x").measured}), tables) is None


def test_torchrec_planner_plans_every_type_shard_ray_runs():
    """Free to choose any type, TorchRec's plan comes back as row shards and replicas shard-ray's gang runs."""
    tables = [TableSpec(name="huge", rows=30_000_000, dim=64, pooling_factor=20.0)] + [
        TableSpec(name=f"s{i}", rows=50, dim=16, pooling_factor=1.0) for i in range(6)
    ]
    plan = place("torchrec", tables, Topology(num_devices=4, memory_bytes=4 * GB, batch_size=1024))
    huge = [s for s in plan.shards if s.table == "huge"]
    assert len(huge) > 1  # 7.2 GB does not fit a 4 GB device: TorchRec splits it
    plan.check(tables)


def test_torchrec_planner_over_hosts_of_one_device_gives_a_plan_that_checks():
    """Over hosts of one device TorchRec calls a table on one rank table-row-wise (found by `bench` on 2 emulated
    hosts, which refused the plan): recorded table-wise, as it is laid out."""
    tables = [
        TableSpec(name="user_id", rows=987_994, dim=64, pooling_factor=1.0),
        TableSpec(name="seller", rows=1_000_000, dim=16, pooling_factor=1.0),
        TableSpec(name="hist_items", rows=1_000_000, dim=32, pooling_factor=40.0),
        TableSpec(name="hour", rows=24, dim=4, pooling_factor=1.0),
    ]
    topology = Topology(num_devices=2, memory_bytes=4 * GB, devices_per_host=1, inter_host_gbps=0.006)
    plan = place("torchrec", tables, topology)
    plan.check(tables)
    assert {s.type for s in plan.table_shardings(tables).values()} <= {"table_wise", "column_wise", "data_parallel"}


def test_export_of_a_searched_plan_and_bad_input(tmp_path, capsys):
    tables = generate_pool(PoolConfig(num_tables=12, seed=3))
    tables_file = tmp_path / "tables.json"
    save_tables(tables_file, tables)
    plan = place("cost_search", tables, Topology(num_devices=4, memory_bytes=64 * GB, batch_size=1024))
    exported = export_plan(plan, tables, module_path="sparse_arch.embedding_bag_collection")
    assert set(exported.tables) == {t.name for t in tables}
    for name, table in exported.tables.items():
        rows = next(t.rows for t in tables if t.name == name)
        if table.sharding_type == "data_parallel":
            assert table.ranks == [0, 1, 2, 3] and table.shards == []
        elif table.sharding_type == "row_wise":
            assert sum(s.sizes[0] for s in table.shards) == rows
        else:
            assert all(s.sizes[0] == rows for s in table.shards)
            assert sum(s.sizes[1] for s in table.shards) == next(t.dim for t in tables if t.name == name)
    sharding = sharding_plan(exported)
    assert set(sharding.plan) == {"sparse_arch.embedding_bag_collection"}

    wrong = tmp_path / "wrong.json"
    wrong.write_text(
        json.dumps({"num_devices": 2, "algorithm": "x", "shards": [{"table": "nope", "device": 0, "columns": [0, 4]}]})
    )
    assert (
        main(["export", "--plan", str(wrong), "--tables", str(tables_file), "--out", str(tmp_path / "out.json")]) == 2
    )
    assert capsys.readouterr().err.startswith("shard-ray: error:") and not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_bench_on_a_table_file_with_torchrec(ray_session, tmp_path, capsys):
    tables_file = tmp_path / "mine.json"
    save_tables(tables_file, generate_pool(PoolConfig(num_tables=6, seed=8)))
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--tasks",
            "0",
            "--tables",
            str(tables_file),
            "--devices",
            "2",
            "--repeats",
            "2",
            "--rounds",
            "3",
            "--memory-headroom",
            "3",
            "--algorithms",
            "size_greedy,torchrec,cost_search",
            "--no-mlflow",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    headline = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert headline["tasks"] == 1 and headline["best_single_heuristic"] == "size_greedy"
    assert set(headline["mean_cost_ms"]) == {"size_greedy", "torchrec", "cost_search"}
    rows = (out / "benchmark.csv").read_text().strip().splitlines()
    assert rows[0].startswith("algorithm,mean_cost_ms") and len(rows) == 4
    report = (out / "benchmark.md").read_text()
    assert (out / "benchmark.png").stat().st_size > 0 and "| torchrec |" in report
    assert f"(those every algorithm planned; table files {tables_file.name})" in report  # no line of 0 synthetic tasks
    assert "percentages are of the plans' median measured costs, with no interval" in report  # not read as claims
    assert main(["bench", "--tasks", "0", "--out", str(tmp_path / "none")]) == 2  # nothing to benchmark


def test_the_benchmark_names_the_algorithms_as_good_as_its_best():
    """Nine algorithms placing a small task's tables alike measure one plan: the report named one of them best, by
    order (from a new user's walk); it names the others as good."""
    from shard_ray.workflows.benchmark import as_good

    summary = {
        "cost_search": {"mean_cost_ms": 1.5},
        "dim_greedy": {"mean_cost_ms": 1.5},
        "random": {"mean_cost_ms": 2.0},
    }
    assert as_good("cost_search", summary) == ["dim_greedy"] and as_good("random", summary) == []
    assert as_good(None, summary) == []


def test_the_benchmark_says_which_algorithms_no_race_measured_slower():
    """A race that separated nothing still has a lowest mean cost: the headline names it `best_algorithm`, and names
    beside it the algorithms no task measured slower than its chosen plan, so that a script does not read the lowest
    median as a winner (a new user's walk: ten plans within noise, `best_algorithm` one of them, nothing else said)."""
    from shard_ray.workflows.benchmark import headline, summarise

    def record(cost_ms: float, verdict: str) -> dict:
        return {"cost_ms": cost_ms, "improvement": 0.0, "over_bound": 0.1, "placement_ms": 1.0, "sim_error": 0.0,
                "verdict": verdict}  # fmt: skip

    per_task = {
        "a": {
            "cost_search": record(1.0, "chosen"),
            "neuroshard": record(1.1, "tied"),
            "size_greedy": record(2, "slower"),
        },
        "b": {
            "cost_search": record(1.2, "tied"),
            "neuroshard": record(1.0, "chosen"),
            "size_greedy": record(1.3, "tied"),
        },
    }
    report = summarise(per_task, {}, {"size_greedy"})
    top = headline({**report, "hardware": "cpu", "tasks": 2})
    assert top["best_algorithm"] == "neuroshard" and top["never_separated_slower"] == ["cost_search", "neuroshard"]
    per_task["a"]["cost_search"]["verdict"] = "slower"
    assert headline({**summarise(per_task, {}, {"size_greedy"}), "hardware": "cpu"})["never_separated_slower"] == [
        "neuroshard"
    ]


def test_a_torchrec_sharding_plan_comes_back_as_the_plan_it_was_exported_from():
    """`plan_from_torchrec` reads the ShardingPlan a model trains with today into a shard-ray plan (to compare, race as
    the incumbent, price): every sharding type over 2 hosts of 4 comes back as it was exported, shard for shard and
    type for type; what is not such a plan of these tables is refused in a line."""
    from shard_ray.interop.torchrec import plan_from_torchrec
    from shard_ray.placement import plan_tables
    from shard_ray.plan.constraints import Constraints

    tables = [TableSpec(name=f"t{i}", rows=300_000 * (i + 1), dim=64, pooling_factor=2.0 + 3 * i) for i in range(10)]
    kinds = {"t0": "data_parallel", "t3": "column_wise", "t5": "table_row_wise", "t9": "row_wise"}
    constraints = Constraints(tables={name: {"types": [kind]} for name, kind in kinds.items()})
    plan = plan_tables("cost_search", tables, Topology(num_devices=8, memory_bytes=GB, devices_per_host=4),
                       constraints=constraints)  # fmt: skip
    assert {name: plan.table_shardings(tables)[name].type for name in kinds} == kinds
    sharding = sharding_plan(export_plan(plan, tables, module_path="sparse.ebc"))
    back = plan_from_torchrec(sharding, tables, plan.topology(), module_path="sparse.ebc", name="current")
    assert sorted(s.model_dump_json() for s in back.shards) == sorted(s.model_dump_json() for s in plan.shards)
    assert back.tables == plan.tables and back.algorithm == "current"
    assert back.settings.tables_digest == plan.settings.tables_digest and back.topology() == plan.topology()
    with pytest.raises(ShardRayError, match=r"no module '' \(its modules: 'sparse.ebc'\): give module_path"):
        plan_from_torchrec(sharding, tables, plan.topology())
    with pytest.raises(ShardRayError, match="expected a TorchRec ShardingPlan, got a Plan"):
        plan_from_torchrec(plan, tables, plan.topology())
    with pytest.raises(ShardRayError, match="shards tables not among these: 't9'"):
        plan_from_torchrec(sharding, tables[:9], plan.topology(), module_path="sparse.ebc")
    # what a team's plan may hold and a shard-ray plan cannot: a type it does not express, rows held off the device
    for field, value, said in (
        ("sharding_type", "table_column_wise", "'t1' is sharded table_column_wise, which a shard-ray plan cannot"),
        ("compute_kernel", "fused_uvm_caching", "'t1' runs TorchRec's fused_uvm_caching kernel, which shard-ray"),
    ):
        module = dict(sharding.plan["sparse.ebc"])
        module["t1"] = dataclasses.replace(module["t1"], **{field: value})
        with pytest.raises(ShardRayError, match=said):
            plan_from_torchrec(
                type(sharding)({"sparse.ebc": module}), tables, plan.topology(), module_path="sparse.ebc"
            )
    # a plan of another world: one table on every rank says how many there are (4 ranks read as 8 devices were taken)
    halves = {name: p for name, p in sharding.plan["sparse.ebc"].items() if name in ("t0", "t9")}
    with pytest.raises(ShardRayError, match="over 8 ranks, where the topology has 16 ranks: give the Topology"):
        plan_from_torchrec(type(sharding)({"": halves}), tables, Topology(num_devices=16, memory_bytes=GB))
    with pytest.raises(ShardRayError, match="is on rank 7, past the topology's 4 devices"):
        plan_from_torchrec(sharding, tables, Topology(num_devices=4, memory_bytes=GB), module_path="sparse.ebc")
    # what export_plan takes from a script as the command's flags take it
    with pytest.raises(ShardRayError, match="device_type must be 'cuda' or 'cpu'"):
        export_plan(plan, tables, device_type="gpu")
    with pytest.raises(ShardRayError, match="module path 'sparse..ebc' has an empty name between its dots"):
        export_plan(plan, tables, module_path="sparse..ebc")
    assert export_plan(plan, tables, module_path="layers.0.ebc").module_path == "layers.0.ebc"  # a Sequential's index
    with pytest.raises(ShardRayError, match="over the cap of 0.100 GiB"):
        plan_from_torchrec(sharding, tables, Topology(num_devices=8, memory_bytes=GB // 10, devices_per_host=4),
                           module_path="sparse.ebc")  # fmt: skip
