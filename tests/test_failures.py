"""Failure and recovery: nothing measured is lost or stored twice when profiling actors die."""

import threading
import time

from shard_ray.profiling.actors import ProfilingPool
from shard_ray.profiling.fused_shard import MeasureConfig, shard_key
from shard_ray.profiling.sampling import draw_shards
from shard_ray.profiling.store import MeasurementStore

# Enough timed steps that a shard takes a good fraction of a second, so kills land mid-shard.
SLOW = MeasureConfig(batch_size=1024, warmup=2, repeats=25)


def test_profiling_survives_killed_actors(ray_session, tmp_path, small_tables):
    shards = draw_shards(small_tables, count=10, max_tables=4, seed=3)
    keys = {shard_key(s, SLOW, "") for s in shards}  # distinct shards (hardware does not change identity here)
    pool = ProfilingPool(num_actors=2)
    db = tmp_path / "m.db"
    kills: list[int] = []  # shards stored when each kill landed

    def kill_during_the_run() -> None:
        with MeasurementStore(db) as watcher:
            for n in range(4):
                while watcher.count() < 1 + 2 * n:
                    time.sleep(0.05)
                # three restarts, then one actor killed for good: its shard must move to the other
                ray_session.kill(pool.actors[n % 2], no_restart=(n == 3))
                kills.append(watcher.count())
                time.sleep(0.3)

    killer = threading.Thread(target=kill_during_the_run, daemon=True)
    try:
        with MeasurementStore(db) as store:
            killer.start()
            results = pool.measure(shards, SLOW, store, progress=False)
            killer.join(timeout=60)
            assert len(kills) == 4 and all(k < len(keys) for k in kills), kills  # every kill hit a running measurement
            assert len(pool.actors) == 1
            assert all(r is not None and r.status == "ok" for r in results)
            assert store.count() == len(keys)  # every distinct shard, exactly once
            assert [r.key for r in results] == [shard_key(s, SLOW, pool.hardware) for s in shards]
    finally:
        pool.shutdown()


def test_gang_rebuilds_itself_when_a_member_dies(ray_session, small_tables):
    from shard_ray.placement import place
    from shard_ray.plan.topology import GB, Topology
    from shard_ray.profiling.gang import DeviceGang

    topology = Topology(num_devices=2, memory_bytes=GB, batch_size=1024)
    plans = [place(name, small_tables, topology) for name in ("dim_greedy", "size_greedy", "lookup_greedy", "round_robin")]
    gang = DeviceGang(2)
    kills: list[int] = []  # plans finished when each kill landed
    finished: list[int] = []

    def kill_members() -> None:
        for n in range(3):
            time.sleep(0.6)
            members = list(gang.members)
            if not members:
                return
            ray_session.kill(members[n % 2])
            kills.append(len(finished))
            while gang.restarts <= n or not gang.members:  # wait for the new gang
                time.sleep(0.05)

    killer = threading.Thread(target=kill_members, daemon=True)
    try:
        killer.start()
        costs = []
        for plan in plans:
            costs.append(gang.evaluate(plan, small_tables, SLOW))
            finished.append(1)
        killer.join(timeout=120)
        assert len(kills) == 3 and all(k < len(plans) for k in kills), kills
        assert gang.restarts == 3
        assert len(costs) == len(plans)
        assert all(d.fwd_compute_ms > 0 and d.fwd_comm_ms > 0 for c in costs for d in c.devices)
    finally:
        gang.shutdown()
