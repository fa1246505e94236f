#!/usr/bin/env bash
# shellcheck disable=SC2016  # sh -c '..."$0"...' and the log hint are meant literally
# Start a real local multi-node Slurm cluster (munge + MariaDB + slurmdbd + slurmctld + N slurmd).
#
#   bash scripts/slurm/up.sh          # (make slurm-up) idempotent; prints a one-line summary
#   TULA_SLURM_SITE=strict bash scripts/slurm/up.sh   # (make slurm-up SITE=strict) a site profile,
#                                     # scripts/slurm/sites/<name>.sh; another profile running is restarted fresh
#   source work/slurm/slurm.env       # exports SLURM_CONF for sinfo/sbatch/srun/sacct
#   bash scripts/slurm/down.sh        # (make slurm-down)
#
# Nodes are network namespaces (netns mode): bridge tula-br0 10.77.0.1/24 on the host,
# node<i> = netns tula-node<i> with eth0 10.77.0.(10+i), its own hostname (UTS namespace), one
# slurmd each; slurmctld (hostname tula-ctl) and slurmdbd run on the host at 10.77.0.1.
# Names resolve through /etc/hosts lines marked "# tula-hpc-slurm".
# Without namespaces (loopback mode) every slurmd runs on 127.0.0.1 with its own Port and -N.
#
# Environment knobs: TULA_SLURM_SITE=permissive|strict, TULA_SLURM_MODE=auto|netns|loopback, TULA_SLURM_CGROUP=auto|yes|no,
# TULA_SLURM_NODES=2, TULA_SLURM_NODE_GPUS=2 (stand-in gres), TULA_SLURM_DIR=<repo>/work/slurm,
# TULA_SLURM_UP_TIMEOUT=60,
# TULA_SLURM_SLURMD_TIMEOUT=15 (see common.sh for the rest).
set -euo pipefail

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

load_site
require_root
T0=$(date +%s.%N)
take_lock
SLURMD_TIMEOUT="${TULA_SLURM_SLURMD_TIMEOUT:-15}"
REQ_CGROUP="${TULA_SLURM_CGROUP:-auto}"

# ---- 1. packages -----------------------------------------------------------------------------
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  # the package lists are needed once; `apt-get update` only if the install can't find them
  if ! apt-get install -y -q "${PKGS[@]}" >"/tmp/tula-slurm-apt.$$.log" 2>&1; then
    apt-get update -q >>"/tmp/tula-slurm-apt.$$.log" 2>&1 || true
    apt-get install -y -q "${PKGS[@]}" >>"/tmp/tula-slurm-apt.$$.log" 2>&1 ||
      { tail -n 30 "/tmp/tula-slurm-apt.$$.log" >&2; die "apt-get install ${PKGS[*]} failed"; }
  fi
  rm -f "/tmp/tula-slurm-apt.$$.log"
fi
for c in munged mungekey mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd sacctmgr sinfo sacct setpriv setsid; do
  command -v "$c" >/dev/null || die "required command '$c' not found after install"
done
munge_paths

mkdir -p "$ETC" "$LOG" "$PIDS" "$RUN" "$SPOOL/ctld" "$DB_DIR"
chmod go-w "$STATE" "$ETC" "$LOG" "$PIDS" "$RUN" "$SPOOL" 2>/dev/null || true

# ---- helpers ---------------------------------------------------------------------------------
# start_daemon NAME CMD...: start CMD detached (own session; stdin /dev/null, stdout+stderr to
# log/NAME.out, the daemons' own log files are set in their configs) and record its PID. Every
# wrapper used in CMD (setsid, setpriv, nsenter, unshare, sh -c 'exec') execs, so the recorded
# PID is the daemon itself. Detaching matters: a caller that captures our output (pytest,
# subprocess.run) must not wait on daemons holding its pipe, and its Ctrl-C must not reach them.
start_daemon() {
  local name="$1"; shift
  setsid "$@" </dev/null >>"$LOG/$name.out" 2>&1 9>&- &
  echo $! >"$PIDS/$name.pid"
}

fail_with_log() { # MESSAGE LOGFILE...
  local msg="$1" f; shift
  printf '[slurm] ERROR: %s\n' "$msg" >&2
  for f in "$@"; do
    [ -s "$f" ] || continue
    printf -- '---- last lines of %s ----\n' "$f" >&2
    tail -n 25 "$f" >&2
  done
  printf '[slurm] the cluster is left as is for inspection; `bash scripts/slurm/down.sh` cleans up\n' >&2
  exit 1
}

# started NAME: the daemon runs, or its recorded PID is still one of the wrappers that exec it
# (setsid, setpriv, nsenter, unshare, sh): right after start_daemon, is_running alone would call a
# daemon that has not exec'd yet dead.
started() {
  is_running "$1" && return 0
  local pid exe
  pid="$(tr -dc '0-9' <"$PIDS/$1.pid" 2>/dev/null)" || return 1
  [ -n "$pid" ] && alive "$pid" || return 1
  exe="$(readlink -f "/proc/$pid/exe" 2>/dev/null)" || return 0 # unreadable while it execs
  case "${exe##*/}" in setsid | setpriv | nsenter | unshare | sh | dash | bash) return 0 ;; esac
  is_running "$1" # it may have exec'd since the first look
}

DEADLINE=$(( $(date +%s) + UP_TIMEOUT ))
# wait_until DESCRIPTION DAEMON_NAME|- LOGFILE CMD...: poll CMD until it succeeds (or the overall
# deadline passes, or the named daemon died)
wait_until() {
  local desc="$1" dname="$2" logf="$3"; shift 3
  while ! "$@" >/dev/null 2>&1; do
    if [ "$dname" != "-" ] && ! started "$dname"; then
      fail_with_log "$dname exited while waiting for: $desc" "$logf" "$LOG/$dname.out"
    fi
    [ "$(date +%s)" -lt "$DEADLINE" ] || fail_with_log "timed out (${UP_TIMEOUT}s) waiting for: $desc" "$logf" "$LOG/$dname.out"
    sleep 0.2
  done
}

render() { # TEMPLATE OUT MODE VAR=VALUE...
  local tpl="$1" out="$2" mode="$3" content kv; shift 3
  content="$(<"$tpl")"
  for kv in "$@"; do content="${content//@${kv%%=*}@/${kv#*=}}"; done
  if grep -q '@[A-Z_]*@' <<<"$content"; then die "unrendered placeholder in $tpl: $(grep -o '@[A-Z_]*@' <<<"$content" | sort -u | tr '\n' ' ')"; fi
  (umask 077; printf '%s\n' "$content" >"$out.tmp")
  chmod "$mode" "$out.tmp"
  mv -f "$out.tmp" "$out"
}

# site_accounting: the profile's QOS (made, or set to the profile's limits) and root's association in the profile's
# account, allowed every one of them; that account becomes root's default (a job naming none runs there). Account
# `root` (slurmdbd makes it with the cluster) is left as it is. Idempotent: the DB outlives restarts and profiles.
site_accounting() {
  local entry qos_name allowed=normal
  for entry in "${SITE_QOS[@]}"; do
    qos_name="${entry%% *}"
    allowed+=",$qos_name"
    [ -n "$(sacctmgr -n -P show qos "$qos_name" format=name)" ] || sacctmgr -i add qos "$qos_name" >/dev/null ||
      fail_with_log "sacctmgr add qos $qos_name failed" "$LOG/slurmdbd.log"
    # shellcheck disable=SC2086  # the limits are words
    sacctmgr -i modify qos "$qos_name" set ${entry#* } >/dev/null
  done
  if [ "$SITE_ACCOUNT" != root ]; then
    [ -n "$(sacctmgr -n -P show account "$SITE_ACCOUNT" format=account)" ] ||
      sacctmgr -i add account "$SITE_ACCOUNT" cluster="$CLUSTER_NAME" description="site $SITE" organization=tula >/dev/null ||
      fail_with_log "sacctmgr add account $SITE_ACCOUNT failed" "$LOG/slurmdbd.log"
    [ -n "$(sacctmgr -n -P show assoc users=root account="$SITE_ACCOUNT" format=user)" ] ||
      sacctmgr -i add user root account="$SITE_ACCOUNT" cluster="$CLUSTER_NAME" >/dev/null ||
      fail_with_log "sacctmgr add user root account=$SITE_ACCOUNT failed" "$LOG/slurmdbd.log"
    sacctmgr -i modify user root where account="$SITE_ACCOUNT" set qos="$allowed" defaultqos=normal >/dev/null
  fi
  sacctmgr -i modify user root set defaultaccount="$SITE_ACCOUNT" >/dev/null
}

netns_possible() {
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null || return 1
  unshare --uts true 2>/dev/null || return 1
  ip netns add "${NS_PREFIX}probe$$" 2>/dev/null || return 1
  ip netns del "${NS_PREFIX}probe$$" 2>/dev/null || true
  ip link add "${VETH_PREFIX}p$$" type bridge 2>/dev/null || return 1
  ip link del "${VETH_PREFIX}p$$" 2>/dev/null || true
  return 0
}

cgroup_v1_usable() {
  [ -d /sys/fs/cgroup/memory ] && [ -d /sys/fs/cgroup/freezer ] && [ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ] || return 1
  local probe="/sys/fs/cgroup/memory/tula_probe_$$"
  mkdir "$probe" 2>/dev/null || return 1
  rmdir "$probe" 2>/dev/null || true
  return 0
}

net_setup() { # idempotent
  local i n ns veth ip
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip addr replace "$CTL_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for ((i = 1; i <= NNODES; i++)); do
    n="node$i"; ns="$NS_PREFIX$i"; veth="$VETH_PREFIX$i"; ip="$(node_ip "$i")"
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip -n "$ns" link del eth0 2>/dev/null || true
      ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$BRIDGE"
    ip link set "$veth" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr replace "$ip/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

hosts_add() { # (re)write our marked lines
  hosts_remove
  local i lines=""
  if [ "$MODE" = netns ]; then
    lines+="$CTL_IP $CTL_NAME $MARK"$'\n'
    for ((i = 1; i <= NNODES; i++)); do lines+="$(node_ip "$i") node$i $MARK"$'\n'; done
  else
    lines+="127.0.0.1 $(node_names | tr '\n' ' ')$MARK"$'\n'
  fi
  # make sure the file ends with a newline before appending
  if [ -s /etc/hosts ] && [ "$(tail -c1 /etc/hosts | od -An -c | tr -d ' ')" != '\n' ]; then echo >>/etc/hosts; fi
  printf '%s' "$lines" >>/etc/hosts
}

# ---- 2. what is already running? -------------------------------------------------------------
running=(); stopped=()
for d in $(all_daemon_names); do
  if is_running "$d"; then running+=("$d"); else stopped+=("$d"); fi
done

RUNNING_SITE="$(cat "$SITE_FILE" 2>/dev/null || echo permissive)" # a cluster older than profiles was permissive
if [ "${#running[@]}" -gt 0 ] && [ -r "$MODE_FILE" ] && [ -r "$SLURM_CONF_PATH" ] && [ "$RUNNING_SITE" = "$SITE" ]; then
  FRESH=0
  MODE="$(cat "$MODE_FILE")"
  CGROUPS="$(grep -q '^ProctrackType=proctrack/cgroup' "$SLURM_CONF_PATH" && echo yes || echo no)"
  if [ "${#stopped[@]}" -eq 0 ]; then
    say "already running (${running[*]}), mode $MODE, site $SITE - nothing to start"
  else
    say "partially running; (re)starting: ${stopped[*]}"
  fi
else
  FRESH=1
  if [ "${#running[@]}" -gt 0 ] && [ "$RUNNING_SITE" != "$SITE" ]; then
    say "running as site $RUNNING_SITE: restarting it fresh as site $SITE"
    cancel_all_jobs
  elif [ "${#running[@]}" -gt 0 ]; then
    warn "daemons running (${running[*]}) but state files are missing: stopping them for a fresh start"
  fi
  if [ "${#running[@]}" -gt 0 ]; then
    for d in $(all_daemon_names | tac); do stop_daemon "$d"; done
  fi
  mapfile -t stopped < <(all_daemon_names)
  # leftovers of a crashed/killed earlier run
  kill_netns_procs
  cgroup_sweep
  net_teardown
  hosts_remove
  rm -f "$PIDS"/*.pid
  case "$REQ_MODE" in
    netns) netns_possible || die "TULA_SLURM_MODE=netns but network namespaces/bridges/UTS namespaces are not usable here"; MODE=netns ;;
    loopback) MODE=loopback ;;
    auto) if netns_possible; then MODE=netns; else MODE=loopback; fi ;;
    *) die "TULA_SLURM_MODE must be auto, netns or loopback (got '$REQ_MODE')" ;;
  esac
  case "$REQ_CGROUP" in
    yes) cgroup_v1_usable || die "TULA_SLURM_CGROUP=yes but a writable cgroup v1 memory+freezer hierarchy is not mounted"; CGROUPS=yes ;;
    no) CGROUPS=no ;;
    auto) if cgroup_v1_usable; then CGROUPS=yes; else CGROUPS=no; fi ;;
    *) die "TULA_SLURM_CGROUP must be auto, yes or no (got '$REQ_CGROUP')" ;;
  esac
  if [ "$SITE_NEEDS_CGROUPS" = yes ] && [ "$CGROUPS" != yes ]; then
    die "site $SITE needs cgroups (its limits are enforced there), but TULA_SLURM_CGROUP=$REQ_CGROUP or no writable cgroup v1 memory+freezer hierarchy is mounted"
  fi
  if [ "$SITE_CONSTRAIN_CORES" = yes ] && [ ! -w /sys/fs/cgroup/cpuset/cpuset.cpus ]; then
    die "site $SITE confines cores, but no writable cgroup v1 cpuset hierarchy is mounted at /sys/fs/cgroup/cpuset"
  fi
  echo "$MODE" >"$MODE_FILE"
  echo "$SITE" >"$SITE_FILE"
  # keep the previous logs once, start new ones (the job-id scan also reads *.log.1)
  for f in "$LOG"/*.log "$LOG"/*.out; do [ -e "$f" ] && mv -f "$f" "$f.1"; done
  # node spool dirs hold per-node job state of the previous incarnation: start clean
  rm -rf "$SPOOL"/slurmd.*
fi

if [ "$MODE" = netns ]; then
  CTL_ADDR="$CTL_IP"; CTL_HOST="$CTL_NAME"; DBD_ADDR="$CTL_IP"
else
  CTL_ADDR="127.0.0.1"; CTL_HOST="$(hostname -s)"; DBD_ADDR="127.0.0.1"
fi

# ---- 3. network + names ----------------------------------------------------------------------
if [ "$MODE" = netns ]; then net_setup; fi
hosts_add

# ---- 4. munge --------------------------------------------------------------------------------
if ! is_running munged; then
  id munge >/dev/null 2>&1 || die "user 'munge' missing (package munge not installed properly?)"
  mkdir -p "$MUNGE_DIR"
  if [ ! -s "$MUNGE_DIR/munge.key" ]; then
    mungekey -c -k "$MUNGE_DIR/munge.key" >/dev/null
  fi
  chown -R munge:munge "$MUNGE_DIR"
  chmod 0755 "$MUNGE_DIR"          # the socket must be reachable by any job user
  chmod 0400 "$MUNGE_DIR/munge.key"
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  : >>"$MUNGE_LOG"; chown munge:munge "$MUNGE_LOG"
  start_daemon munged \
    setpriv --reuid=munge --regid=munge --init-groups \
    munged -F --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_LOG" --seed-file="$MUNGE_DIR/munged.seed"
fi
munge_ok() { munge -S "$MUNGE_SOCKET" -n | unmunge -S "$MUNGE_SOCKET"; }
wait_until "munged answering on $MUNGE_SOCKET" munged "$MUNGE_LOG" munge_ok

# ---- 5. MariaDB ------------------------------------------------------------------------------
DB_PASS_FILE="$DB_DIR/slurm.pass"
if [ ! -s "$DB_PASS_FILE" ]; then
  (umask 077; head -c 64 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24 >"$DB_PASS_FILE")
fi
DB_PASS="$(cat "$DB_PASS_FILE")"
if ! is_running mariadbd; then
  if [ ! -d "$DB_DATA/mysql" ]; then
    say "initialising MariaDB datadir $DB_DATA"
    rm -rf "$DB_DATA"; mkdir -p "$DB_DATA"
    mariadb-install-db --no-defaults --datadir="$DB_DATA" --user=root \
      --auth-root-authentication-method=socket --skip-test-db >"$LOG/mariadb-install.log" 2>&1 ||
      fail_with_log "mariadb-install-db failed" "$LOG/mariadb-install.log"
  fi
  rm -f "$DB_SOCKET"
  start_daemon mariadbd \
    mariadbd --no-defaults --user=root --datadir="$DB_DATA" --socket="$DB_SOCKET" \
    --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
    --pid-file="$DB_DIR/mariadbd.pid" --log-error="$LOG/mariadb.log" \
    --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
    --innodb-flush-log-at-trx-commit=2 --max-connections=100
fi
wait_until "MariaDB answering on $DB_SOCKET" mariadbd "$LOG/mariadb.log" \
  mariadb-admin --no-defaults -S "$DB_SOCKET" -u root ping
mariadb --no-defaults -S "$DB_SOCKET" -u root <<SQL || fail_with_log "could not create the slurm DB user" "$LOG/mariadb.log"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL

# ---- 6. configs (fresh start only: running daemons keep the config they read) ----------------
if [ "$FRESH" = 1 ] || [ ! -r "$SLURM_CONF_PATH" ]; then
  LAST_ID="$(last_job_id)"
  echo "$LAST_ID" >"$JOBID_FILE"
  FIRST_JOB_ID=$((LAST_ID + 1))
  NODE_LINES=""; NODE_LIST=""
  # stand-in GPUs: --gpus-per-node=N is accepted and scheduled; nothing computes, nothing is bound
  # (ConstrainDevices=no). Slurm wants a device file per GPU: character devices that are /dev/null.
  case "$NODE_GPUS" in ''|*[!0-9]*) die "TULA_SLURM_NODE_GPUS must be a number (got '$NODE_GPUS')" ;; esac
  if [ "$NODE_GPUS" -gt 0 ]; then
    NODE_GRES="Gres=gpu:$NODE_GPUS"
    # accounted too (sacct AllocTRES shows gres/gpu=N), as on real GPU clusters
    GRES_LINES="GresTypes=gpu"$'\n'"AccountingStorageTRES=gres/gpu"
    rm -rf "$GPU_DEV_DIR"; mkdir -p "$GPU_DEV_DIR"
    for ((g = 0; g < NODE_GPUS; g++)); do
      # a regular file would do too, but slurmd logs "not a valid character or block device" for it
      mknod -m 666 "$GPU_DEV_DIR/gpu$g" c 1 3 2>/dev/null || : >"$GPU_DEV_DIR/gpu$g"
    done
    if [ "$NODE_GPUS" -eq 1 ]; then gpu_files="$GPU_DEV_DIR/gpu0"; else gpu_files="$GPU_DEV_DIR/gpu[0-$((NODE_GPUS - 1))]"; fi
    render "$SLURM_SCRIPTS_DIR/templates/gres.conf.in" "$GRES_CONF_PATH" 644 \
      "NODE_GPUS=$NODE_GPUS" "GPU_FILES=$gpu_files"
  else
    NODE_GRES=""; GRES_LINES=""
    rm -f "$GRES_CONF_PATH"; rm -rf "$GPU_DEV_DIR"
  fi
  for ((i = 1; i <= NNODES; i++)); do
    if [ "$MODE" = netns ]; then
      addr="NodeAddr=$(node_ip "$i") NodeHostname=node$i"
    else
      addr="NodeAddr=127.0.0.1 NodeHostname=localhost Port=$((LOOP_PORT_BASE + i))"
    fi
    NODE_LINES+="NodeName=node$i $addr CPUs=$NODE_CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$NODE_MEM_MB${NODE_GRES:+ $NODE_GRES} State=UNKNOWN"$'\n'
    NODE_LIST+="${NODE_LIST:+,}node$i"
  done
  NODE_LINES="${NODE_LINES%$'\n'}"
  if [ "$CGROUPS" = yes ]; then
    PROCTRACK=proctrack/cgroup; TASK_PLUGIN="$SITE_TASK_PLUGIN"; ACCT_FREQ=10; JOBACCT_PARAMS=""
    render "$SLURM_SCRIPTS_DIR/templates/cgroup.conf.in" "$ETC/cgroup.conf" 644 "CONSTRAIN_CORES=$SITE_CONSTRAIN_CORES"
  else
    # no cgroups: memory is policed by polling (every 2 s) and killing over-limit steps
    PROCTRACK=proctrack/linuxproc; TASK_PLUGIN=task/none; ACCT_FREQ=2
    JOBACCT_PARAMS="JobAcctGatherParams=OverMemoryKill"
    rm -f "$ETC/cgroup.conf"
  fi
  render "$SLURM_SCRIPTS_DIR/templates/slurm.conf.in" "$SLURM_CONF_PATH" 644 \
    "MODE=$MODE" "CLUSTER=$CLUSTER_NAME" "CTL_NAME=$CTL_HOST" "CTL_ADDR=$CTL_ADDR" \
    "CTLD_PORT=$CTLD_PORT" "SLURMD_PORT=$SLURMD_PORT" "MUNGE_SOCKET=$MUNGE_SOCKET" \
    "SPOOL=$SPOOL" "RUN=$RUN" "LOG=$LOG" "FIRST_JOB_ID=$FIRST_JOB_ID" \
    "PROCTRACK=$PROCTRACK" "TASK_PLUGIN=$TASK_PLUGIN" "ACCT_FREQ=$ACCT_FREQ" \
    "JOBACCT_PARAMS=$JOBACCT_PARAMS" "DBD_ADDR=$DBD_ADDR" "DBD_PORT=$DBD_PORT" \
    "DEF_MEM_PER_CPU=$DEF_MEM_PER_CPU" "SLURMD_TIMEOUT=$SLURMD_TIMEOUT" "GRES_LINES=$GRES_LINES" \
    "NODE_LINES=$NODE_LINES" "NODE_LIST=$NODE_LIST" "SITE=$SITE" "JOB_REQUEUE=$SITE_JOB_REQUEUE" \
    "PREEMPT_MODE=$SITE_PREEMPT_MODE" "DEBUG_PARTITION_OPTS=${SITE_DEBUG_PARTITION_OPTS:+$SITE_DEBUG_PARTITION_OPTS }" \
    "EXTRA_PARTITIONS=$SITE_EXTRA_PARTITIONS" "ENFORCE=${SITE_ENFORCE:+AccountingStorageEnforce=$SITE_ENFORCE}"
  render "$SLURM_SCRIPTS_DIR/templates/slurmdbd.conf.in" "$ETC/slurmdbd.conf" 600 \
    "MUNGE_SOCKET=$MUNGE_SOCKET" "DBD_PORT=$DBD_PORT" "LOG=$LOG" "RUN=$RUN" \
    "DB_PORT=$DB_PORT" "DB_PASS=$DB_PASS"
fi
printf 'export SLURM_CONF=%q\n' "$SLURM_CONF_PATH" >"$STATE/slurm.env"

# ---- 7. slurmdbd + cluster registration ------------------------------------------------------
if ! is_running slurmdbd; then
  start_daemon slurmdbd slurmdbd -D
fi
wait_until "slurmdbd answering (sacctmgr show cluster)" slurmdbd "$LOG/slurmdbd.log" \
  sacctmgr -n show cluster
if [ -z "$(sacctmgr -n -P show cluster "$CLUSTER_NAME" format=cluster 2>/dev/null)" ]; then
  sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null ||
    fail_with_log "sacctmgr add cluster $CLUSTER_NAME failed" "$LOG/slurmdbd.log"
fi

# the site's account and QOS, before slurmctld reads the associations (fresh start: the DB outlives restarts)
[ "$FRESH" = 0 ] || site_accounting

# ---- 8. slurmctld ----------------------------------------------------------------------------
if ! is_running slurmctld; then
  ctld_args=(slurmctld -D -f "$SLURM_CONF_PATH")
  # fresh start: forget old jobs/node states (drain reasons...), ids continue via FirstJobId
  [ "$FRESH" = 1 ] && ctld_args+=(-c)
  if [ "$MODE" = netns ]; then
    start_daemon slurmctld \
      unshare --uts sh -c 'hostname "$0"; exec "$@"' "$CTL_NAME" "${ctld_args[@]}"
  else
    start_daemon slurmctld "${ctld_args[@]}"
  fi
fi
wait_until "slurmctld answering (scontrol ping)" slurmctld "$LOG/slurmctld.log" \
  sh -c 'scontrol ping | grep -q UP'

# ---- 9. slurmd per node ----------------------------------------------------------------------
for ((i = 1; i <= NNODES; i++)); do
  n="node$i"
  is_running "slurmd-$n" && continue
  mkdir -p "$SPOOL/slurmd.$n"
  if [ "$MODE" = netns ]; then
    # NOT `ip netns exec`: it remounts /sys, hiding the cgroup mounts, and slurmd aborts
    start_daemon "slurmd-$n" \
      nsenter --net="/run/netns/$NS_PREFIX$i" unshare --uts \
      sh -c 'hostname "$0"; exec "$@"' "$n" slurmd -D -f "$SLURM_CONF_PATH"
  else
    start_daemon "slurmd-$n" slurmd -D -f "$SLURM_CONF_PATH" -N "$n"
  fi
done

# ---- 10. health ------------------------------------------------------------------------------
nodes_idle() {
  local states
  states="$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null)" || return 1
  local n
  for n in $(node_names); do
    grep -qE "^$n (idle|mix|alloc)\$" <<<"$states" || return 1
  done
}
slurmd_logs=(); for n in $(node_names); do slurmd_logs+=("$LOG/slurmd.$n.log"); done
while ! nodes_idle; do
  for n in $(node_names); do
    started "slurmd-$n" || fail_with_log "slurmd for $n exited" "$LOG/slurmd.$n.log" "$LOG/slurmd-$n.out" "$LOG/slurmctld.log"
  done
  if [ "$(date +%s)" -ge "$DEADLINE" ]; then
    sinfo -N -l >&2 || true
    fail_with_log "timed out (${UP_TIMEOUT}s) waiting for all nodes idle in sinfo" "$LOG/slurmctld.log" "${slurmd_logs[@]}"
  fi
  sleep 0.2
done
wait_until "sacct answering" slurmdbd "$LOG/slurmdbd.log" sacct -n -X -S now-1hour

if [ "$FRESH" = 1 ]; then
  # jobs the DB still believes running (an earlier slurmctld died with them): close them
  sacctmgr -i show runawayjobs >/dev/null 2>&1 || true
fi

T1=$(date +%s.%N)
say "UP: cluster $CLUSTER_NAME, site=$SITE, mode=$MODE, cgroups=$CGROUPS, nodes=$(node_names | paste -sd, -) ($(sinfo -h -p debug -o '%t' | sort -u | paste -sd, -)), $([ "$FRESH" = 1 ] && echo "first job id $FIRST_JOB_ID, ")$(awk -v a="$T0" -v b="$T1" 'BEGIN{printf "%.1f", b-a}')s; run: source $STATE/slurm.env"
