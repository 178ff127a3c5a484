import sys

from shard_ray.cli import main

sys.exit(main())
