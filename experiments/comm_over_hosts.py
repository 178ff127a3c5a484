"""All-to-alls measured across hosts emulated on this machine, beside what the cost models price them at.

    python experiments/comm_over_hosts.py --out comm-out [--rates 200mbit,1gbit] [--layouts 2x1,3x1,4x1,2x2] [--plans 4]
        [--tables experiments/tables/criteo_kaggle.json]

For each link rate and layout (HOSTSxDEVICES per host) it brings up an emulated cluster (`shard-ray hosts up`,
root only), runs `--plans` random table-wise plans of the tables (Criteo Kaggle's unless `--tables`; each record
names its file) on a gang spanning its hosts (3
interleaved rounds, batch 1024), and takes the cluster down. Every device's measured input distribution and
forward and backward all-to-all is written beside three prices of it:

- `flat`: the shipped models on one host (what `plan` prices without `--devices-per-host`);
- `hosts`: the same with the inter-host share at the links' measured rate (`plan --devices-per-host L
  --inter-host-gbps R`, `shard_ray.costmodel.pricing.over_hosts`);
- `received`: the bytes the device receives from other hosts over that rate (`inter_host_ms`, as `over_hosts` prices);
- `host_link`: the same with the host's one link carrying all its devices' bytes.

`--reprice` (and every run, at its end) adds today's price, with each device's own link (`now`) and with the host's
devices sharing its one link (`shared`, `plan --host-link-gbps`), as the emulated hosts do; and `fitted`: the price
at the rate and kind of link (a device's own or its host's shared) that calibrate's fit (`fit_link_between_hosts`)
finds in the all-to-alls of at most 4 devices at the same link setting; and `torchrec`: TorchRec's estimator's price
(`torchrec_table_wise_comms`, its tables' sum). It prints the error of `fitted`, `now` and `torchrec` at 8 and 16
devices: the median over devices and parts of |measured / priced - 1|, the same over collectives (each its slowest
device, measured and priced), and the Spearman correlation of the plans' all-to-alls (each plan's slowest device),
measured against priced.

Writes `comm_over_hosts.json` and prints the median ratio of measured to priced per layout. Figures: docs/clusters.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.errors import ShardRayError

BATCH = 1024
ROUNDS = 3
TABLES = "experiments/tables/criteo_kaggle.json"


def random_plans(tables: list, num_devices: int, count: int, seed: int) -> list:
    """`count` table-wise plans of the tables over `num_devices`, devices drawn with skewed to even shares."""
    from shard_ray.plan.piece import TablePiece
    from shard_ray.plan.plan import Plan

    rng = np.random.default_rng(seed)
    plans = []
    for i in range(count):
        shares = rng.dirichlet(np.full(num_devices, (0.5, 1.0, 5.0)[i % 3]))
        devices = rng.choice(num_devices, size=len(tables), p=shares)
        devices[:num_devices] = np.arange(num_devices)  # every device holds a table
        plans.append(Plan.from_assignment([TablePiece.whole(t) for t in tables], devices, num_devices, f"random{i}"))
    return plans


def measure_inside(layout: str, plans: int, link_mbit: float, table_file: str, out: Path) -> None:
    """In host 0 of the cluster: measure the plans on a gang of every device and price them; write `out`."""
    from shard_ray.costmodel.models import CostModels, default_cost_model_path
    from shard_ray.costmodel.pricing import Pricer, input_width, inter_host_ms, output_width
    from shard_ray.plan.topology import GB, Topology
    from shard_ray.profiling.gang import DeviceGang
    from shard_ray.profiling.procedure import MeasureConfig
    from shard_ray.runtime import connect_ray
    from shard_ray.workload.tables import load_tables

    hosts, per_host = (int(x) for x in layout.split("x"))
    devices = hosts * per_host
    connect_ray()
    tables = load_tables(table_file)
    models = CostModels.load(default_cost_model_path())
    gbytes = link_mbit / 8 / 1e3
    drawn = random_plans(tables, devices, plans, seed=devices)
    with DeviceGang(devices, devices_per_host=per_host) as gang:
        measured = gang.evaluate_rounds(drawn, tables, MeasureConfig(batch_size=BATCH, seed=0), rounds=ROUNDS)
    records = []
    for plan, cost in zip(drawn, measured):
        pieces, assign = plan.assignment(tables)
        priced = {}
        for name, local in (("flat", None), ("hosts", per_host if hosts > 1 else None)):
            topology = Topology(
                num_devices=devices, memory_bytes=GB, batch_size=BATCH, devices_per_host=local, inter_host_gbps=gbytes
            )
            priced[name] = Pricer(models, topology).plan_parts(pieces, assign).plan_cost("priced", BATCH).devices
        out_width = np.bincount(assign, weights=[output_width(p) for p in pieces], minlength=devices)
        in_width = np.bincount(assign, weights=[input_width(p) for p in pieces], minlength=devices)
        host_of = np.arange(devices) // per_host
        # what each device receives from other hosts (the pricing's own `inter_host_ms`): forward and backward of
        # the pooled columns, and the ids of its tables in the input all-to-all
        received_out = inter_host_ms(out_width, BATCH, per_host, gbytes)
        received_in = inter_host_ms(in_width, BATCH, per_host, gbytes)
        for d, device in enumerate(cost.devices):
            other = host_of != host_of[d]
            own_host = host_of == host_of[d]
            # a host's link carries all its devices' traffic
            host_scale = {
                "fwd_comm_ms": out_width[other].sum() * own_host.sum() / devices,
                "bwd_comm_ms": out_width[own_host].sum() * other.sum() / devices,
                "input_dist_ms": in_width[own_host].sum() * other.sum() / devices,
            }
            records.append(
                {
                    "tables": table_file,
                    "layout": layout,
                    "link_mbit": link_mbit,
                    "plan": plan.algorithm,
                    "device": d,
                    "measured": {k: getattr(device, k) for k in host_scale},
                    "flat": {k: getattr(priced["flat"][d], k) for k in host_scale},
                    "hosts": {k: getattr(priced["hosts"][d], k) for k in host_scale},
                    "received": {
                        "fwd_comm_ms": received_out[d, 0],
                        "bwd_comm_ms": received_out[d, 1],
                        "input_dist_ms": received_in[d, 1],
                    },
                    "host_link": {k: w * BATCH * 4 / (gbytes * 1e9) * 1e3 for k, w in host_scale.items()},
                    "step_ms": cost.cost_ms,
                }
            )
    out.write_text(json.dumps(records, indent=1))


def price_now(records: list[dict], tables: list) -> None:
    """Adds to each record `now`: the device's all-to-alls as `plan --devices-per-host L --inter-host-gbps R` prices
    them today (the comm model's price, never below the links': `shard_ray.costmodel.links`), the plans drawn again
    from their seeds; and `shared`: the same with `--host-link-gbps R`, the host's devices sharing its one link, as
    the emulated hosts' do."""
    from shard_ray.costmodel.models import CostModels, default_cost_model_path
    from shard_ray.costmodel.pricing import Pricer
    from shard_ray.interop.torchrec import torchrec_table_wise_comms
    from shard_ray.plan.topology import GB, Topology

    models = CostModels.load(default_cost_model_path())
    fitted = fit_from_few(records, tables)
    for layout, link_mbit in sorted({(r["layout"], r["link_mbit"]) for r in records}):
        hosts, per_host = (int(x) for x in layout.split("x"))
        devices = hosts * per_host
        rows = [r for r in records if (r["layout"], r["link_mbit"]) == (layout, link_mbit)]
        plans = {
            p.algorithm: p for p in random_plans(tables, devices, 1 + max(int(r["plan"][6:]) for r in rows), devices)
        }
        topology = Topology(
            num_devices=devices,
            memory_bytes=GB,
            batch_size=BATCH,
            devices_per_host=per_host if hosts > 1 else None,
            inter_host_gbps=link_mbit / 8 / 1e3,
        )
        # the emulated hosts' devices share their host's one link: `--host-link-gbps` at its rate
        prices = {"now": topology, "shared": topology.model_copy(update={"host_link_gbps": link_mbit / 8 / 1e3})}
        if nominal_rate(rows[0]) in fitted:
            gbps, shared = fitted[nominal_rate(rows[0])]
            update = {"inter_host_gbps": gbps, "host_link_gbps": gbps if shared else None}
            prices["fitted"] = topology.model_copy(update=update)
        by_torchrec = torchrec_table_wise_comms(tables, topology)
        for r in rows:
            pieces, assign = plans[r["plan"]].assignment(tables)
            for name, priced_on in prices.items():
                parts = Pricer(models, priced_on).plan_parts(pieces, assign)
                device = parts.plan_cost("priced", BATCH).devices[r["device"]]
                r[name] = {k: getattr(device, k) for k in r["measured"]}
            held = [p.table.name for p, d in zip(pieces, assign) if d == r["device"]]
            summed = np.sum([by_torchrec[name] for name in held], axis=0)
            r["torchrec"] = dict(zip(("input_dist_ms", "fwd_comm_ms", "bwd_comm_ms"), summed.tolist()))


# The link settings the runs asked for, in Mbit/s; a record's is the one nearest the rate its links achieved.
NOMINAL_MBIT = (25, 50, 200, 1000)
FEW_DEVICES = 4


def nominal_rate(record: dict) -> int:
    return min(NOMINAL_MBIT, key=lambda n: abs(np.log(record["link_mbit"] / n)))


def received_mb(record: dict, plan, tables: list) -> dict[str, tuple[float, float]]:
    """Per all-to-all of the record's device, the MB per step it received from other hosts and the MB its whole
    host did (`received_floats`, `host_received`): what a link of its own, or one its host shares, carried."""
    from shard_ray.costmodel.pricing import host_received, input_width, output_width, received_floats

    hosts, per_host = (int(x) for x in record["layout"].split("x"))
    pieces, assign = plan.assignment(tables)
    carried = {}
    for part, width, phase in (("fwd_comm_ms", output_width, 0), ("bwd_comm_ms", output_width, 1),
                               ("input_dist_ms", input_width, 1)):  # fmt: skip
        widths = np.bincount(assign, weights=[width(p) for p in pieces], minlength=hosts * per_host)
        _, inter = received_floats(widths, per_host)
        own, host = inter[record["device"], phase], host_received(inter, per_host)[record["device"], phase]
        carried[part] = (own * BATCH * 4 / 1e6, host * BATCH * 4 / 1e6)
    return carried


def fit_from_few(records: list[dict], tables: list) -> dict[int, tuple[float, bool]]:
    """Per link setting, the GB/s and the kind of link (shared by a host's devices or not) that calibrate's fit
    (`fit_link_between_hosts`) finds in the all-to-alls measured over at least 2 hosts of at most `FEW_DEVICES`
    devices in all; printed."""
    from shard_ray.costmodel.links import fit_link_between_hosts
    from shard_ray.costmodel.pricing import slowest_of_each

    fitted = {}
    for rate in sorted({nominal_rate(r) for r in records}):
        few = [r for r in records if nominal_rate(r) == rate and _devices(r) <= FEW_DEVICES and _hosts(r) > 1]
        if not few:
            continue
        plans, collectives = {}, {}
        rows = []
        for r in few:
            key = (r["layout"], r["plan"])
            if key not in plans:
                drawn = random_plans(tables, _devices(r), int(r["plan"][6:]) + 1, _devices(r))
                plans[key] = next(p for p in drawn if p.algorithm == r["plan"])
            for part, (own, host) in received_mb(r, plans[key], tables).items():
                rows.append(
                    (0.0, own, r["measured"][part], host, collectives.setdefault((*key, part), len(collectives)))
                )
        # as `calibrate` fits them: each collective's slowest device
        slowest = slowest_of_each(np.array(rows))
        fixed_ms, gbps, shared, errors = fit_link_between_hosts(slowest[:, 1], slowest[:, 3], slowest[:, 2])
        layouts = ", ".join(sorted({r["layout"] for r in few}))
        achieved = sorted({r["link_mbit"] for r in few})
        print(
            f"{rate} Mbit/s links: fitted {gbps * 8e3:.1f} Mbit/s and {fixed_ms:.2f} ms a collective, "
            f"{'one link a host' if shared else 'a link a device'} (median errors: a link a device "
            f"{errors.get(False, float('nan')):.1%}, one a host {errors.get(True, float('nan')):.1%}), to {len(slowest)} all-to-alls of "
            f"{layouts} (achieved {achieved[0]:.1f}-{achieved[-1]:.1f} Mbit/s)",
            flush=True,
        )
        fitted[rate] = (gbps, shared)
    return fitted


def _hosts(record: dict) -> int:
    return int(record["layout"].split("x")[0])


def _devices(record: dict) -> int:
    hosts, per_host = (int(x) for x in record["layout"].split("x"))
    return hosts * per_host


def summarise(records: list[dict]) -> None:
    parts = ("input_dist_ms", "fwd_comm_ms", "bwd_comm_ms")
    for key in sorted({(r["link_mbit"], r["layout"]) for r in records}):
        rows = [r for r in records if (r["link_mbit"], r["layout"]) == key]
        line = [f"{key[0]:.0f} Mbit/s, {key[1]}: {len(rows)} devices"]
        for price in ("flat", "hosts", "received", "host_link", "now", "shared", "fitted", "torchrec"):
            if price not in rows[0]:
                continue
            ratios = [r["measured"][p] / r[price][p] for r in rows for p in parts if r[price][p] > 0]
            line.append(f"measured/{price} {np.median(ratios):.2f}" if ratios else f"{price} -")
        print("; ".join(line), flush=True)
        # the figure docs/clusters.md gives: per plan, the device with the most measured all-to-all time (input,
        # forward and backward together), its measured over priced; the median over the plans
        slowest = [max(same, key=lambda r: sum(r["measured"][p] for p in parts)) for same in _by_plan(rows)]
        line = [f"  slowest device of each of {len(slowest)} plans, median"]
        for price in ("flat", "received", "host_link", "now", "shared", "fitted", "torchrec"):
            if price in rows[0]:
                ratios = [sum(r["measured"][p] for p in parts) / sum(r[price][p] for p in parts) for r in slowest]
                line.append(f"measured/{price} {np.median(ratios):.2f}")
        print("; ".join(line), flush=True)


def summarise_fit(records: list[dict]) -> None:
    """The `fitted` price's error at more than `FEW_DEVICES` devices, beside today's shipped price (`now`) and
    TorchRec's estimator's (`torchrec`), per link setting and device count: the median over devices and parts of
    |measured / priced - 1|, the same over collectives (each its slowest device, measured and priced: what the
    step waits for), and the Spearman correlation of each plan's slowest device's all-to-alls, measured
    against priced, over the plans of every layout of that count."""
    from scipy.stats import spearmanr

    parts = ("input_dist_ms", "fwd_comm_ms", "bwd_comm_ms")
    for key in sorted({(nominal_rate(r), _devices(r)) for r in records if "fitted" in r}):
        if key[1] <= FEW_DEVICES:
            continue
        rows = [r for r in records if "fitted" in r and (nominal_rate(r), _devices(r)) == key]
        slowest = [max(same, key=lambda r: sum(r["measured"][p] for p in parts)) for same in _by_plan(rows)]
        line = [f"{key[0]} Mbit/s, {key[1]} devices ({', '.join(sorted({r['layout'] for r in rows}))})"]
        for price in ("fitted", "now", "torchrec"):
            errors = [abs(r["measured"][p] / r[price][p] - 1) for r in rows for p in parts if r[price][p] > 0]
            # a collective takes as long as its slowest device: measured and priced, each its most
            spans = [
                abs(max(r["measured"][p] for r in same) / max(r[price][p] for r in same) - 1)
                for same in _by_plan(rows)
                for p in parts
            ]
            rho = spearmanr([sum(r["measured"][p] for p in parts) for r in slowest],
                            [sum(r[price][p] for p in parts) for r in slowest]).statistic  # fmt: skip
            line.append(
                f"{price}: median error {np.median(errors):.1%} a device, {np.median(spans):.1%} a collective, "
                f"Spearman of {len(slowest)} plans {rho:.2f}"
            )
        print("; ".join(line), flush=True)


def _by_plan(rows: list[dict]) -> list[list[dict]]:
    plans: dict[object, list[dict]] = {}
    for r in rows:
        plans.setdefault((r["layout"], r["plan"]), []).append(r)
    return list(plans.values())


def main(argv: list[str]) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=a_folder_to_write, required=True)
    parser.add_argument("--rates", default="200mbit,1gbit")
    parser.add_argument("--layouts", default="2x1,3x1,4x1,2x2")
    parser.add_argument("--plans", type=int, default=4)
    parser.add_argument("--tables", default=TABLES, help="the table file whose plans are measured")
    parser.add_argument("--reprice", default=None, help="price the records of an earlier run (its JSON) as today")
    parser.add_argument("--inside", default=None, help=argparse_hidden())
    parser.add_argument("--link-mbit", type=float, default=None, help=argparse_hidden())
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.reprice:
        import gzip

        opened = gzip.open if args.reprice.endswith(".gz") else open
        with opened(args.reprice, "rt") as handle:
            records = json.load(handle)
        out.mkdir(parents=True, exist_ok=True)
        price_and_summarise(records, out)
        return 0
    if args.inside:
        measure_inside(args.inside, args.plans, args.link_mbit, args.tables, out)
        return 0
    from shard_ray.hosts import bring_up, command_in_head, tear_down

    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    for rate in args.rates.split(","):
        for layout in args.layouts.split(","):
            hosts, per_host = (int(x) for x in layout.split("x"))
            state = bring_up("commexp", hosts, per_host, rate, progress=lambda line: print(line, flush=True))
            try:
                link = round(min(r.mbit_per_s for r in state.link_rates), 1)
                part = out / f"{rate}-{layout}.json"
                inside = [sys.executable, __file__, "--inside", layout, "--plans", str(args.plans)]
                inside += ["--link-mbit", f"{link:.1f}", "--tables", args.tables, "--out", str(part.resolve())]
                argv_in, env = command_in_head(state, inside)
                subprocess.run(argv_in, env=env, check=True)
                records += json.loads(part.read_text())
                summarise([r for r in records if r["layout"] == layout and r["link_mbit"] == link])
            finally:
                tear_down(state)
    price_and_summarise(records, out)
    return 0


def price_and_summarise(records: list[dict], out: Path) -> None:
    """Prices the records as today, table file by table file (records before `--tables` are Criteo Kaggle's), writes
    them to `out` and prints the summaries."""
    from shard_ray.workload.tables import load_tables

    for table_file in sorted({r.get("tables", TABLES) for r in records}):
        print(f"{table_file}:", flush=True)
        same = [r for r in records if r.get("tables", TABLES) == table_file]
        price_now(same, load_tables(table_file))
        summarise(same)
        summarise_fit(same)
    (out / "comm_over_hosts.json").write_text(json.dumps(records, indent=1))


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ShardRayError as err:
        print(f"comm_over_hosts: error: {err}", file=sys.stderr)
        sys.exit(2)
