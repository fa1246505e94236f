"""Training: the task a model is trained for, which every stage asks the same questions (tasks.py); models (models.py,
with the GPT of gpt.py); data sets (datasets.py, with text.py's text and token files, synthetic.py's samples made on
the device and data_check.py's torch-free checks) and the loaders that shard them over ranks (loaders.py); the step
every stage runs (step.py) at the job's precision (precision.py); optimisers (optimizers.py) and their learning-rate
maths (lr_schedule.py); the large-batch strategies (strategies.py) with AGS (ags.py) and AdaScale's progress
(progress.py); the gradient noise scale DDP's all-reduce measures (noise_scale.py); checkpoints (checkpoint.py),
preemption (preemption.py), the loop's time accounting (loop_accounting.py), the loop itself (trainer.py), its
validation (validation.py), what the train stage hands it (handoff.py) and its attempts after running out of memory
(attempts.py), and the trained model's scores (evaluation.py).

May import core, cluster and memory; modules here that stages on a login node read (progress.py, attempts.py,
handoff.py) import no torch, and so neither does this file.
"""
