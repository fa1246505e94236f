"""The launchers behind one interface, one module each, as submitit keeps core/, local/ and slurm/ apart behind one
executor: the interface every launcher implements, with the task it runs on each rank and how a job's failure is told
(interface.py); the local launcher with its bad-exit watchdog (local.py); one sbatch job per stage run (slurm.py);
a step of the measuring phase's shared allocation (shared_allocation.py); which launcher runs a job, by its name
(registry.py); and the job.json record a rerun re-attaches by (job_record.py).

A stage never imports these: it calls tula_hpc.cluster.launch, which runs a worker through them and retries.
"""
