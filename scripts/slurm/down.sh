#!/usr/bin/env bash
# Stop the local Slurm cluster started by scripts/slurm/up.sh (make slurm-down). Idempotent.
#
#   bash scripts/slurm/down.sh           # stop everything, keep DB + munge key + logs + configs
#   bash scripts/slurm/down.sh --purge   # ... and delete work/slurm entirely (job history too)
#
# Order: cancel all jobs (so accounting closes them), stop slurmd's, sweep leftover processes in
# our namespaces / slurm_nodeX cgroups, slurmctld, slurmdbd, mariadbd, munged (each: SIGTERM,
# SIGKILL after a grace period; only PIDs recorded in work/slurm/pids/ and verified by executable
# and environment marker), then delete netns tula-node*, veths tula-veth*, bridge tula-br0 and the
# /etc/hosts lines marked "# tula-hpc-slurm".
#
# Job ids: the highest id handed out is saved in work/slurm/jobid.last (and is in the accounting
# DB); the next up.sh starts slurmctld with -c (no stale jobs, drain states or node spool) and
# FirstJobId=last+1, so ids never repeat - submitit/sacct never see an old job under a new id.
set -euo pipefail

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PURGE=0
for a in "$@"; do
  case "$a" in
    --purge) PURGE=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) die "unknown option '$a' (only --purge)" ;;
  esac
done
require_root
[ -d "$STATE" ] && take_lock
munge_paths

# 1. cancel jobs while the controller is still there, so they end CANCELLED in sacct
cancel_all_jobs

# 2. remember the highest job id (slurmctld log / DB still readable now)
if [ -d "$STATE" ]; then
  last="$(last_job_id 2>/dev/null || echo 0)"
  [ "${last:-0}" -gt 0 ] && echo "$last" >"$JOBID_FILE"
fi

# 3. daemons, compute side first
for d in $(all_daemon_names | grep '^slurmd-' || true); do stop_daemon "$d" 8; done
# job steps outlive slurmd (slurmstepd is its own process): sweep what is left
kill_netns_procs
cgroup_sweep
for d in slurmctld slurmdbd mariadbd munged; do
  grace=8; [ "$d" = mariadbd ] && grace=20
  stop_daemon "$d" "$grace"
done

still=()
for pid in "${STOPPED_PIDS[@]}"; do alive "$pid" && still+=("$pid"); done
[ "${#still[@]}" -eq 0 ] || die "daemons still running after SIGKILL: pids ${still[*]}"

# 4. network, names
net_teardown
hosts_remove

# 5. state that would confuse a fresh start (the next up.sh also clears it)
if [ "$PURGE" = 1 ]; then
  rm -rf "$STATE"
  rm -rf "$MUNGE_RUN_DIR"
  say "DOWN (purged $STATE)"
elif [ -d "$STATE" ]; then
  rm -rf "$SPOOL"/slurmd.* "$SPOOL/ctld" "$RUN" "$PIDS"
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock" "$DB_SOCKET"
  say "DOWN (kept DB, munge key, logs in $STATE; next job id $(( $(cat "$JOBID_FILE" 2>/dev/null || echo 0) + 1 )))"
else
  say "DOWN (no state dir $STATE)"
fi
