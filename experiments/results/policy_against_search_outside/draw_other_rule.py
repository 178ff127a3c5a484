"""A table pool drawn by a rule of its own, kept outside the repository: not shard-ray's generator, not its files.
Rows log-uniform over 10^2..10^8, dims from {8, 24, 48, 96, 256}, pooling factors log-uniform over 1..80, a third
of the tables Zipf-skewed (exponent 0.6..1.4), a fifth in fp16."""

import json
import sys

import numpy as np

rng = np.random.default_rng(int(sys.argv[2]))
n = int(sys.argv[1])
tables = []
for i in range(n):
    t = {
        "name": f"f{i:03d}",
        "rows": int(10 ** rng.uniform(2, 8)),
        "dim": int(rng.choice([8, 24, 48, 96, 256])),
        "pooling_factor": round(float(np.exp(rng.uniform(0, np.log(80)))), 2),
    }
    if rng.random() < 1 / 3:
        t["zipf_exponent"] = round(float(rng.uniform(0.6, 1.4)), 2)
    if rng.random() < 0.2:
        t["precision"] = "fp16"
    tables.append(t)
print(json.dumps({"tables": tables}, indent=0))
