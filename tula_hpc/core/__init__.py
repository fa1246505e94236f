"""The ground floor: a job's settings as typed data (job.py, plain_data.py), what each stage depends on
(dependencies.py), the records stages hand each other (records.py), how a run lies over ranks and nodes
(run_layout.py), files written atomically (atomic_files.py) and the error a stage fails with (errors.py).

No torch here, and no import from any other folder of tula_hpc: everything above may import it.
"""
