# shellcheck shell=bash disable=SC2034
# Site profile `permissive` (the default): the local cluster as it always was. Jobs are requeueable, the one
# partition never preempts, cores are shared by every task of a node, no limit is enforced.
# A profile is data: up.sh sources it and puts these values into templates/{slurm,cgroup}.conf.in.
SITE_NEEDS_CGROUPS=no                # yes: refuse to start without a usable cgroup v1 (its limits would not hold)
SITE_JOB_REQUEUE=1                   # slurm.conf JobRequeue
SITE_PREEMPT_MODE=REQUEUE            # slurm.conf PreemptMode (PreemptType=preempt/partition_prio)
SITE_DEBUG_PARTITION_OPTS=""         # more settings of the default partition `debug`
SITE_EXTRA_PARTITIONS=""             # more PartitionName= lines (Nodes=ALL: every node)
SITE_CONSTRAIN_CORES=no              # cgroup.conf ConstrainCores
SITE_TASK_PLUGIN=task/cgroup         # slurm.conf TaskPlugin where cgroups are usable (task/none where not)
SITE_ENFORCE=""                      # slurm.conf AccountingStorageEnforce (empty: none)
SITE_ACCOUNT=root                    # root's default account; another is made, root's association in it
                                     # allowed every QOS below
SITE_QOS=()                          # "NAME LIMIT..." per QOS, made (or updated) with sacctmgr
