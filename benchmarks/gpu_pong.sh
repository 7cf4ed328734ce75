#!/usr/bin/env bash
# Names-only SEED + V-trace on ALE/Pong-v5 with the learner and inference on cuda, for
# a fixed wall time (default 8 minutes), as many env runners as the cores allow (one
# core each, two left to the learner and Ray). Prints the frames/s and the return, and
# leaves the run folder (metrics.jsonl, curve.png, run.log) under OUT.
#
#   bash benchmarks/gpu_pong.sh [SECONDS]       # OUT defaults to runs/gpu_check
set -euo pipefail
seconds=${1:-480}
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
cores=$(nproc)
runners=$(( cores > 3 ? cores - 2 : 1 ))
cat > "$out/pong_gpu.yaml" <<SPEC
arch: seed
algo: vtrace
env: ALE/Pong-v5
SPEC
rlfabric train "$out/pong_gpu.yaml" run.name=pong_gpu "run.logdir=$out" run.display=plain \
  "run.stop.wall_time_s=$seconds" resources.num_gpus_per_learner=1 \
  "resources.num_env_runners=$runners" "resources.num_cpus=$cores" \
  > "$out/pong_gpu.out" 2>&1 || echo "pong_gpu: rlfabric train exited with $?" >&2
python - "$out/pong_gpu" <<'PY'
import json, sys
from pathlib import Path
records = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").open()]
last = records[-1]
print(
    f"pong_gpu: {last['env_frames']:,} env frames in {last['wall_time_s']:.0f} s "
    f"({last['env_frames'] / last['wall_time_s']:,.0f} frames/s), "
    f"learner_on_gpu {last.get('learner_on_gpu')}, "
    f"return (100 ep) {last.get('episode_return_mean', float('nan')):.2f}"
)
PY
tail -3 "$out/pong_gpu.out"
