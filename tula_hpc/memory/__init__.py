"""Device memory: the budget a rank may allocate and its enforcement (device_budget.py, with the CPU allocator in
csrc/), the parts of a training step whose memory the probes record (step_parts.py), and the memory model that
predicts a step's peak from a few probes (model.py; the probes themselves run the training step and live in
profiling/).

May import core and cluster.
"""
