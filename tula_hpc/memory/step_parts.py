"""The parts of a training step's memory in the words a probe records them (profiling/memory_probes.py, in the
worker) and the memory model reads them (model.py, in the stage): apart from the model, so that a probe's process
need not import scikit-learn (0.8 s of each fresh probe process's start here)."""

PHASES = ("forward", "backward", "update")
STEP_KINDS = ("ordinary", "update")
PARTS = tuple(f"{kind}/{phase}" for kind in STEP_KINDS for phase in PHASES)
# Each figure a peak is read in (device_budget.PEAK_COUNTS), and the key of a probe's peak per part in it.
PART_PEAKS = {"allocated": "peaks", "reserved": "reserved_peaks"}
PEAK = {"allocated": "peak_bytes", "reserved": "reserved_peak_bytes"}
