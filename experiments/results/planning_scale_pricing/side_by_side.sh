#!/bin/bash
# Faster pricing (e6aeaa4) against the commit before (66fa04a), alternately,
# twice each, every plan in a fresh process on one core (experiments/planning_scale.py --one). Run from the
# repository root of this release with PREVIOUS naming a worktree of 66fa04a (git worktree add $PREVIOUS 66fa04a);
# each line of runs.txt: repetition, size, algorithm, release, planning_scale's JSON.
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
