from shard_ray.cli import console

console()
