"""Measuring the training step as training runs it: its peak memory at a few batches (memory_probes.py, what the
memory model is fitted to; run by the probe stage's worker, memory_worker.py, and summarised into memory.json by
memory_summary.py) and its time split into data, compute and sync (step_timing.py, what the performance model is
fitted to), measured in the profile jobs the profile and adapt stages submit (profile_jobs.py).

May import core, cluster, memory and training.
"""
