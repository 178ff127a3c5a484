#!/bin/bash
# This checkout's placement against another commit's, alternately, twice each, every plan in a fresh process on one
# core (experiments/planning_scale.py --one). Run from the repository root with PREVIOUS naming a worktree of the
# other commit (git worktree add $PREVIOUS COMMIT); each line of its output: repetition, size, algorithm, release,
# planning_scale's JSON. Here: the policy's candidates and the comm model in numpy (76f6551) against 33fa2c9 (runs.txt);
# faster pricing (e6aeaa4) against 66fa04a (../planning_scale_pricing/runs.txt); the policy's greedy finish (a8197d2)
# against eabb3e7 (../planning_scale_policy_finish/runs.txt).
here=$(pwd)
for rep in 1 2; do
 for size in 100x8 856x64 5136x512 10000x1024; do
  for algo in dreamshard cost_search; do
   for rel in prev this; do
     if [ $rel = prev ]; then dir=$PREVIOUS; else dir=$here; fi
     line=$(cd $dir && OMP_NUM_THREADS=1 PYTHONPATH=$dir timeout 400 python experiments/planning_scale.py --one $algo:$size 2>/dev/null | tail -1)
     echo "$rep $size $algo $rel $line"
   done
  done
 done
done
