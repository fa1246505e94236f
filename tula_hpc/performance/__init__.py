"""The parallel performance model and the choice it serves: the estimator (estimator.py) on collective costs
(collective_cost.py), its presets where a job names none (sync_priors.py), fitted to the profiles (fitting.py);
the loader's pace the steps cannot outrun (loader_rate.py); predictions of every candidate (prediction.py) with the
run's warm-up and epoch ends (run_overhead.py), the epochs they add up to (epochs.py) and prices (pricing.py); the
search modes (search_modes.py), the choice (choice.py) and the batch schedule that repeats it during training
(batch_schedule.py).

May import core, cluster, memory and training (the noise scale's meaning, training/progress.py). No torch at import:
the plan, fit-model, select and adapt stages run here on a login node.
"""
