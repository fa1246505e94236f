# shellcheck shell=bash disable=SC2034
# Site profile `strict`: a real site's settings at once. A job of the normal partition `debug` is cancelled when
# one of `urgent` (same nodes, higher PriorityTier) needs its cores: SIGTERM at once, SIGKILL 20 s later
# (GraceTime), state PREEMPTED. Nothing is requeueable unless it asks (JobRequeue=0). A task gets only the cores it
# asked for (cgroup cpuset). Limits are enforced: QOS `capped` allows one node per job, so a 2-node job under it
# pends with reason QOSMaxNodePerJobLimit. The variables are described in permissive.sh.
SITE_NEEDS_CGROUPS=yes
SITE_JOB_REQUEUE=0
SITE_PREEMPT_MODE=CANCEL
SITE_DEBUG_PARTITION_OPTS="PriorityTier=1 PreemptMode=CANCEL GraceTime=20"
SITE_EXTRA_PARTITIONS="PartitionName=urgent Nodes=ALL MaxTime=04:00:00 PriorityTier=2 PreemptMode=OFF State=UP"
SITE_CONSTRAIN_CORES=yes
SITE_TASK_PLUGIN=task/cgroup,task/affinity
SITE_ENFORCE=associations,limits,qos
SITE_ACCOUNT=tula
SITE_QOS=("capped MaxTRESPerJob=node=1")
