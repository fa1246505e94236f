"""Where jobs run: the devices of a node (devices.py), torch.distributed set-up (distributed.py), launching a stage's
workers locally or on Slurm through submitit (launch.py, launch_spec.py), the measuring allocation (allocation.py),
a failed rank's record of why its job step ended (job_step_failures.py), Slurm's job states (slurm_states.py) and
the partition's limits and a job's wall time (partition.py).

May import core only.
"""
