#!/bin/bash
# The own-tables guide's calibrate (docs/own-tables.md, its 5 tables in my_model.json in the current folder), this
# checkout (REPO) and another commit's worktree (PREVIOUS) in turn, each run in a fresh home and store, every
# process's CPU sampled from /proc every 0.5 s (cpu_sampler.py); here: one set of device actors (the pool on the
# gang's members) against d6d4e98, 7 repetitions (calibrate_runs.json; the wall times printed by this script).
here=$(dirname "$(readlink -f "$0")")
for rep in 1 2 3 4 5 6 7; do
 for rel in before this; do
  if [ $rel = before ]; then pp=$PREVIOUS; else pp=$REPO; fi
  rm -rf home-$rel-$rep m-$rel-$rep.db; mkdir home-$rel-$rep
  python3 "$here/cpu_sampler.py" cpu-$rel-$rep.txt & sp=$!
  s=$(date +%s.%N)
  HOME=$PWD/home-$rel-$rep PYTHONPATH=$pp "$REPO/.venv/bin/shard-ray" calibrate --tables my_model.json --devices 2 \
    --shards 40 --plans 12 --budget-minutes 15 --no-mlflow --store m-$rel-$rep.db --out x-$rel-$rep.pt > out-$rel-$rep.log 2>&1
  rc=$?
  e=$(date +%s.%N)
  kill -TERM $sp; wait $sp
  echo "$rep $rel rc=$rc wall=$(echo "$e - $s" | bc) cpu=$(tail -1 cpu-$rel-$rep.txt)"
 done
done
