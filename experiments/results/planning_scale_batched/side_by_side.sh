#!/bin/bash
# This checkout's placement against another commit's: each release's whole `planning_scale.py` run (every plan in a fresh
# process on one core), alternately, twice each. Run from the repository root with PREVIOUS naming a worktree of the
# other commit (git worktree add $PREVIOUS COMMIT). Here: candidates priced in one call (0425d6a, 22d1602) against
# 221ca62 (runs.txt: old1, new1, old2, new2 in that order).
here=$(pwd)
for rep in 1 2; do
  for rel in old new; do
    if [ $rel = old ]; then dir=$PREVIOUS; else dir=$here; fi
    (cd $dir && PYTHONPATH=$dir OMP_NUM_THREADS=1 python experiments/planning_scale.py \
      --sizes 100x8,856x64,5136x512 --algorithms cost_search,neuroshard --out $here/$rel$rep > $here/$rel$rep.log 2>&1)
    grep -E "^(cost_search|neuroshard) " $here/$rel$rep.log | sed "s/^/$rel$rep /"
  done
done
