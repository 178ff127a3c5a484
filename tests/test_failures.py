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
