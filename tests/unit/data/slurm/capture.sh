#!/usr/bin/env bash
# Records what `squeue -h -j ID -o %T` and `sacct -n -P -j ID -o State` print for jobs in each end state,
# on the local cluster (bash scripts/slurm/up.sh; source work/slurm/slurm.env). Jobs run their work under
# srun, as submitit's do, so a step carries the cause. About 90 s (the time limit is 1 minute).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
submit() { sbatch --parsable -J "capture-$1" -N 1 -o /dev/null "${@:2}"; }
record() { # NAME JOB_ID
  squeue -h -j "$2" -o %T >"$1.squeue.txt" 2>/dev/null || true
  sacct -n -P -j "$2" -o State >"$1.sacct.txt"
}
finished() { [ -z "$(squeue -h -j "$1" -o %T 2>/dev/null)" ]; }

pending=$(submit pending --begin=now+1hour --wrap "srun true")
running=$(submit running --time=5 --wrap "srun sleep 120")
completed=$(submit completed --wrap "srun true")
failed=$(submit failed --wrap "srun sh -c 'exit 3'")
oom=$(submit oom --mem=100M --wrap "srun python3 -c 'x = b\"1\" * (600 << 20); import time; time.sleep(5)'")
cancelled=$(submit cancelled --wrap "srun sleep 120")
timeout=$(submit timeout --time=1 --wrap "srun sleep 600")
sleep 10
record pending "$pending"
record running "$running"
scancel "$pending" "$running"
scancel "$cancelled"
for name in completed failed oom cancelled timeout; do
  id="${!name}"
  while ! finished "$id"; do sleep 2; done
  sleep 5 # accounting lags squeue
  record "$name" "$id"
done
