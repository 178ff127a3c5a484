#!/bin/bash
# PPO with a GPU learner: `shard-ray policy train` as docs/commands.md writes it, on a GPU machine with torch but no Ray.
#
#     bash experiments/gpu_ppo_learner.sh WHEELS POOL OUT [RUNNERS]
#
# WHEELS: a folder of cp312 wheels carried to the machine (Ray 2.60.0 without its Java jar, gymnasium, dm-tree, lz4,
# ormsgpack, tensorboardX, pydantic, jsonschema and their own needs: the GPU machine's image had the rest); they are
# unpacked into /tmp/site, keeping the files' modes (Ray's gcs_server and raylet must stay executable).
# POOL: a training pool (`shard-ray generate --out pool.json; shard-ray tasks --tables pool.json --out tasks`).
# OUT: where the log and nvidia-smi's samples go. The shipped policy's recipe (`--devices 2,4,8`, hidden 128) and a
# network 4x wider, each with the learner on the GPU and on the CPU (CUDA hidden), one after the other in one run; then
# the recipe with one learner actor on the GPU (`--learners 1`). With RUNNERS, instead: the recipe with the learner on
# the GPU, sampled by RUNNERS env runner actors and then in the driver. Figures: docs/gpu.md.
set -u
WHEELS=$1 POOL=$2 OUT=$3 RUNNERS=${4:-}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/site "$OUT"
python3 -c "
import os, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for member in z.infolist():
            path = z.extract(member, sys.argv[1])
            mode = (member.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
" /tmp/site "$WHEELS"/*.whl || exit 1
LOG=$OUT/log.txt
t0=$(date +%s)
say() { echo "== $(( $(date +%s) - t0 )) s: $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
python3 -c "import torch, ray; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'ray', ray.__version__)" | tee -a "$LOG"
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/smi.csv" 2>&1 &
SAMPLER=$!
train() {
    local name=$1 limit=$2; shift 2
    rm -rf "/tmp/$name"
    say "$name: $*"
    timeout "$limit" python3 -m shard_ray.cli policy train --tables "$POOL" --devices 2,4,8 --validation-tasks 0 \
        --no-mlflow --out "/tmp/$name" "$@" 2>&1 | grep -v "Warning\|warn(" | tee -a "$LOG"
    say "$name done (status ${PIPESTATUS[0]})"
}
if [ -n "$RUNNERS" ]; then
    train "recipe-$RUNNERS-runners" 80 --iterations 3 --env-runners "$RUNNERS"
    train recipe-gpu 70 --iterations 2
else
    train recipe-gpu 90 --iterations 3
    CUDA_VISIBLE_DEVICES= train recipe-cpu 90 --iterations 3
    train recipe-learner-actor 90 --iterations 3 --learners 1
    train wide-gpu 70 --iterations 2 --hidden 512
    CUDA_VISIBLE_DEVICES= train wide-cpu 110 --iterations 2 --hidden 512
fi
kill $SAMPLER
