"""Where jobs run: the devices of a node (devices.py), torch.distributed set-up (distributed.py), running a stage's
workers and retrying them (launch.py) with what their job asks for (launch_spec.py) through the launchers behind one
interface (launchers/, one module each), the
failure record of a rank out of memory (job_step_failures.py), the measuring allocation (allocation.py),
Slurm's job states (slurm_states.py), why a pending job waits (pending.py), files on a shared file system and a lock
that needs no flock (shared_files.py), how resources.slurm becomes Slurm options (slurm_options.py) and the
partition's limits and a job's wall time (partition.py).

May import core only.
"""
