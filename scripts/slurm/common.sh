# shellcheck shell=bash disable=SC2034,SC2086,SC2116
# (variables are used by the sourcing scripts; `echo $pids` deliberately squeezes whitespace)
# Shared settings and helpers for scripts/slurm/up.sh and scripts/slurm/down.sh.
# Sourced, never executed. Everything the local cluster writes lives under $STATE.

SLURM_SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SLURM_SCRIPTS_DIR/../.." && pwd)"

# ---- knobs (environment overrides) ---------------------------------------------------------
STATE="${TULA_SLURM_DIR:-$REPO_ROOT/work/slurm}"
CLUSTER_NAME="${TULA_SLURM_CLUSTER:-tula}"
NNODES="${TULA_SLURM_NODES:-2}"                 # node1 .. nodeN
NODE_CPUS="${TULA_SLURM_NODE_CPUS:-2}"
NODE_MEM_MB="${TULA_SLURM_NODE_MEM_MB:-8000}"
NODE_GPUS="${TULA_SLURM_NODE_GPUS:-2}"           # stand-in gres gpu:N per node (no real GPU; 0: none)
DEF_MEM_PER_CPU="${TULA_SLURM_DEF_MEM_PER_CPU:-2000}"
REQ_MODE="${TULA_SLURM_MODE:-auto}"              # auto | netns | loopback
SITE="${TULA_SLURM_SITE:-permissive}"            # a site profile: scripts/slurm/sites/<SITE>.sh
DB_PORT="${TULA_SLURM_DB_PORT:-3307}"
CTLD_PORT="${TULA_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${TULA_SLURM_SLURMD_PORT:-6818}"    # netns mode: every node on its own IP
LOOP_PORT_BASE="${TULA_SLURM_LOOP_PORT_BASE:-17000}"  # loopback mode: node i listens on BASE+i
DBD_PORT="${TULA_SLURM_DBD_PORT:-6819}"
UP_TIMEOUT="${TULA_SLURM_UP_TIMEOUT:-60}"

# ---- fixed names -----------------------------------------------------------------------------
MARK="# tula-hpc-slurm"          # marker on every /etc/hosts line we add
BRIDGE="tula-br0"
NET_PREFIX="10.77.0"
CTL_IP="$NET_PREFIX.1"
CTL_NAME="tula-ctl"              # controller's hostname (own UTS namespace) in netns mode
NS_PREFIX="tula-node"            # netns tula-node1 ...
VETH_PREFIX="tula-veth"          # host side of the veth pair; the node side is eth0

ETC="$STATE/etc"
LOG="$STATE/log"
PIDS="$STATE/pids"
RUN="$STATE/run"
SPOOL="$STATE/spool"
# munged's files: see munge_paths (its directory depends on user munge, who may not exist before the install).
MUNGE_RUN_DIR="/run/tula-munge-$(printf '%s' "$STATE" | md5sum | cut -c1-12)"
DB_DIR="$STATE/mariadb"
DB_DATA="$DB_DIR/data"
DB_SOCKET="$DB_DIR/mysqld.sock"
SLURM_CONF_PATH="$ETC/slurm.conf"
GRES_CONF_PATH="$ETC/gres.conf"                  # slurmd reads it beside slurm.conf
GPU_DEV_DIR="$STATE/dev"                         # gpu0.. : /dev/null clones that gres.conf calls GPUs
JOBID_FILE="$STATE/jobid.last"
MODE_FILE="$STATE/mode"
SITE_FILE="$STATE/site"                          # the profile the running cluster was started as

export SLURM_CONF="$SLURM_CONF_PATH"
# Every daemon we start carries this in its environment: a second proof (besides the executable
# path) that a recorded PID is really ours and not a recycled one.
export TULA_SLURM_STATE="$STATE"

say()  { printf '[slurm] %s\n' "$*"; }
warn() { printf '[slurm] WARNING: %s\n' "$*" >&2; }
die()  { printf '[slurm] ERROR: %s\n' "$*" >&2; exit 1; }

require_root() {
  if [ "$(id -u)" -ne 0 ]; then
    die "must run as root: it installs packages with apt, creates network namespaces, a bridge and veth pairs, edits /etc/hosts and starts munged/mariadbd/slurmdbd/slurmctld/slurmd (SlurmUser=root). Re-run with sudo."
  fi
}

# take_lock: serialise up.sh/down.sh (parallel `make slurm-up` from test workers). fd 9 is
# closed for every daemon we start, so the lock dies with the script.
take_lock() {
  mkdir -p "$STATE"
  exec 9>>"$STATE/.lock"
  command -v flock >/dev/null || return 0
  flock -w 180 9 || die "another scripts/slurm/up.sh or down.sh holds $STATE/.lock for 180s"
}

site_profiles() { local f; for f in "$SLURM_SCRIPTS_DIR"/sites/*.sh; do basename "$f" .sh; done; }

# load_site: source the profile $SITE (its SITE_* settings), or fail naming the profiles there are.
load_site() {
  # a name, not a path; no `site_profiles | grep -q` (with pipefail, grep leaving early fails the pipe)
  case "$SITE" in '' | *[!A-Za-z0-9_-]*) false ;; *) [ -f "$SLURM_SCRIPTS_DIR/sites/$SITE.sh" ] ;; esac ||
    die "unknown site profile '$SITE' (TULA_SLURM_SITE / make slurm-up SITE=...): one of $(site_profiles | paste -sd, - | sed 's/,/, /g')"
  # shellcheck source=sites/permissive.sh
  source "$SLURM_SCRIPTS_DIR/sites/$SITE.sh"
}

# cancel_all_jobs: while the controller runs, cancel every job and wait (15 s at most) until none is left, so that
# accounting closes them CANCELLED instead of leaving them running for ever.
cancel_all_jobs() {
  is_running slurmctld && [ -r "$SLURM_CONF_PATH" ] || return 0
  local jobs i
  jobs="$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')" || jobs=""
  [ -n "${jobs// /}" ] || return 0
  say "cancelling jobs: $jobs"
  # shellcheck disable=SC2086
  scancel $jobs 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do
    [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
    sleep 0.1
  done
}

node_names() { local i; for ((i = 1; i <= NNODES; i++)); do printf 'node%d\n' "$i"; done; }
node_ip()    { printf '%s.%d\n' "$NET_PREFIX" "$((10 + $1))"; }

# ---- PID bookkeeping -------------------------------------------------------------------------
# pid_of NAME -> prints the recorded PID if that process is alive, runs the expected executable
# (symlinks resolved: /usr/sbin/slurmd -> /etc/alternatives/slurmd -> /usr/sbin/slurmd-wlm) and
# carries our TULA_SLURM_STATE marker. Returns 1 otherwise.
expected_exe() {
  case "$1" in
    munged) command -v munged ;;
    mariadbd) command -v mariadbd ;;
    slurmdbd) command -v slurmdbd ;;
    slurmctld) command -v slurmctld ;;
    slurmd-*) command -v slurmd ;;
    *) return 1 ;;
  esac
}

pid_of() {
  local name="$1" f="$PIDS/$1.pid" pid exe want
  [ -r "$f" ] || return 1
  pid="$(tr -dc '0-9' <"$f")"
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  want="$(expected_exe "$name" 2>/dev/null)" || return 1
  want="$(readlink -f "$want")"
  exe="$(readlink -f "/proc/$pid/exe" 2>/dev/null)" || return 1
  [ "$exe" = "$want" ] || return 1
  # no pipe here: with pipefail, `tr | grep -q` fails when grep exits before tr's last write (an environment over
  # a page), and the daemon then counted as not ours - down.sh left it running.
  grep -qzxF "TULA_SLURM_STATE=$STATE" "/proc/$pid/environ" 2>/dev/null || return 1
  printf '%s\n' "$pid"
}

is_running() { pid_of "$1" >/dev/null; }

all_daemon_names() {
  printf '%s\n' munged mariadbd slurmdbd slurmctld
  local n
  for n in $(node_names); do printf 'slurmd-%s\n' "$n"; done
  # plus any slurmd-* recorded by an earlier run with more nodes
  if [ -d "$PIDS" ]; then
    local f
    for f in "$PIDS"/slurmd-*.pid; do
      [ -e "$f" ] || continue
      n="$(basename "$f" .pid)"
      node_names | sed 's/^/slurmd-/' | grep -qxF "$n" || printf '%s\n' "$n"
    done
  fi
}

# alive PID: some thread of PID still runs. A zombie leader whose other threads are still exiting is alive; a
# process that has wholly exited but is not reaped yet (PID 1 here reaps lazily) is not.
alive() {
  local stat
  for stat in /proc/"$1"/task/*/stat; do
    stat="$(cat "$stat" 2>/dev/null)" || continue
    stat="${stat##*) }"
    case "${stat%% *}" in Z | X | "") ;; *) return 0 ;; esac
  done
  return 1
}

# wait_gone PID SECONDS: wait until PID is not alive; fails if it still is after SECONDS.
wait_gone() {
  local i
  for ((i = 0; i < $2 * 10; i++)); do alive "$1" || return 0; sleep 0.1; done
  ! alive "$1"
}

# stop_daemon NAME [GRACE_SECONDS]: SIGTERM, wait, SIGKILL, wait. Only ever touches a recorded PID that pid_of has
# verified; the PID goes to STOPPED_PIDS, which down.sh checks before it says DOWN.
STOPPED_PIDS=()
stop_daemon() {
  local name="$1" grace="${2:-8}" pid
  if pid="$(pid_of "$name")"; then
    kill -TERM "$pid" 2>/dev/null || true
    if ! wait_gone "$pid" "$grace"; then
      warn "$name (pid $pid) still running ${grace}s after SIGTERM, sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      wait_gone "$pid" 10 || warn "$name (pid $pid) still running 10s after SIGKILL"
    fi
    STOPPED_PIDS+=("$pid")
    say "stopped $name (pid $pid)"
  fi
  rm -f "$PIDS/$name.pid"
}

# munge_paths: set MUNGE_DIR, MUNGE_LOG, MUNGE_SOCKET. munged runs as user munge and must reach its own files;
# under a private parent (mktemp -d makes 0700 directories) it cannot, so its files then live in MUNGE_RUN_DIR.
# Call it only once the packages are installed: before, user munge may not exist and the check cannot be made.
munge_paths() {
  local existing="$STATE"
  while [ ! -e "$existing" ]; do existing="$(dirname "$existing")"; done
  if [ "$(id -u)" = 0 ] && id munge >/dev/null 2>&1 \
     && ! setpriv --reuid=munge --regid=munge --init-groups test -x "$existing" 2>/dev/null; then
    MUNGE_DIR="$MUNGE_RUN_DIR"
    MUNGE_LOG="$MUNGE_DIR/munged.log"
  else
    MUNGE_DIR="$STATE/munge"
    MUNGE_LOG="$LOG/munged.log"
  fi
  MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
}

# ---- network namespaces ----------------------------------------------------------------------
our_netns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}[0-9]+\$" || true; }

# kill every process still inside one of our namespaces (job steps, slurmstepd)
kill_netns_procs() {
  local ns pids sig
  for sig in TERM KILL; do
    pids=""
    for ns in $(our_netns); do pids="$pids $(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"; done
    pids="$(echo $pids)"
    [ -n "$pids" ] || return 0
    say "SIG$sig to leftover processes in tula namespaces: $pids"
    # shellcheck disable=SC2086
    kill -"$sig" $pids 2>/dev/null || true
    sleep 1
  done
}

net_teardown() {
  local ns link
  for ns in $(our_netns); do ip netns del "$ns" 2>/dev/null || warn "could not delete netns $ns"; done
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^${VETH_PREFIX}[0-9]+\$" || true); do
    ip link del "$link" 2>/dev/null || true
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" 2>/dev/null || warn "could not delete $BRIDGE"; fi
}

# ---- /etc/hosts ------------------------------------------------------------------------------
hosts_remove() {
  [ -f /etc/hosts ] || return 0
  grep -qF "$MARK" /etc/hosts || return 0
  local tmp
  tmp="$(mktemp)"
  grep -vF "$MARK" /etc/hosts >"$tmp" || true
  # write in place (keeps the inode: /etc/hosts is often a bind mount in containers)
  cat "$tmp" >/etc/hosts
  rm -f "$tmp"
}

# ---- slurm cgroups (v1) ----------------------------------------------------------------------
# Our slurmd's create <controller>/slurm_<nodename>/... (multiple-slurmd build) - sweep those.
our_cgroup_dirs() {
  local n d
  for n in $(node_names); do
    for d in /sys/fs/cgroup/*/slurm_"$n"; do [ -d "$d" ] && printf '%s\n' "$d"; done
  done
  return 0
}

cgroup_sweep() {
  local d pids sig
  for sig in TERM KILL; do
    pids=""
    for d in $(our_cgroup_dirs); do
      pids="$pids $(find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null | tr '\n' ' ')"
    done
    pids="$(echo $pids | tr ' ' '\n' | sort -u | tr '\n' ' ')"
    pids="$(echo $pids)"
    [ -n "$pids" ] || break
    say "SIG$sig to leftover processes in slurm cgroups: $pids"
    # shellcheck disable=SC2086
    kill -"$sig" $pids 2>/dev/null || true
    sleep 1
  done
  for d in $(our_cgroup_dirs); do
    find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
}

# ---- job id counter --------------------------------------------------------------------------
# Highest job id this cluster ever handed out: max over the accounting DB (needs mariadbd up),
# the slurmctld logs and the counter file written by down.sh.
last_job_id() {
  local best=0 v
  if [ -r "$JOBID_FILE" ]; then v="$(tr -dc '0-9' <"$JOBID_FILE")"; [ -n "$v" ] && [ "$v" -gt "$best" ] && best="$v"; fi
  if [ -S "$DB_SOCKET" ]; then
    v="$(mariadb --no-defaults -S "$DB_SOCKET" -u root -N -B \
         -e "SELECT COALESCE(MAX(id_job),0) FROM slurm_acct_db.\`${CLUSTER_NAME}_job_table\`" 2>/dev/null | tr -dc '0-9')" || v=""
    [ -n "$v" ] && [ "$v" -gt "$best" ] && best="$v"
  fi
  v="$(cat "$LOG"/slurmctld.log* 2>/dev/null | grep -o 'JobId=[0-9]\+' | cut -d= -f2 | sort -n | tail -1)" || v=""
  [ -n "$v" ] && [ "$v" -gt "$best" ] && best="$v"
  printf '%s\n' "$best"
}
