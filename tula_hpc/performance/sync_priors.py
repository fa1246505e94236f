"""What sync costs and how the performance model is fitted where a job says nothing: the presets of
search.sync_prior, search.sync_fit and search.discrepancy_per_octave, by the job's device (NCCL on GPUs, gloo on
CPUs). Plain data: config validation fills a job's defaults from it, and the estimator falls back on it.
"""

from __future__ import annotations

SYNC_KINDS = ("intra_node", "inter_node")  # sync among one host's ranks, and among hosts

# search.sync_prior when a job writes none, by its device (see the estimator's docstring for the terms).
# Whole figures are ints, as YAML reads them: results fingerprinted when jobs wrote these figures still match.
SYNC_PRIORS = {
    # NCCL on a GPU cluster. Latency: NCCL's own tuning model (src/graph/tuning.cc, ring, Simple protocol) counts
    # 3.4 us per NVLink hop, 5.7 us per PCIe hop and 14 us per network hop. Bandwidth: NVLink class within a node,
    # below the per-direction link rate a ring cannot exceed (V100 NVLink 2: 150 GB/s, A100 NVLink 3: 300 GB/s;
    # PCIe-only nodes reach about 20); across nodes one 100 Gb/s NIC per node (EDR InfiniBand, 100 Gb Ethernet).
    "gpu": {
        "intra_node": {"latency_s": 5e-6, "bandwidth_gb_s": 100},
        "inter_node": {"latency_s": 1.4e-5, "bandwidth_gb_s": 12.5},
    },
    # gloo on CPU hosts: tens of us per hop and about 1 GB/s through loopback TCP among one host's ranks, more
    # latency over the network; orders of magnitude, which the profiles replace wherever they hold that sync.
    "cpu": {
        "intra_node": {"latency_s": 5e-5, "bandwidth_gb_s": 1},
        "inter_node": {"latency_s": 1e-4, "bandwidth_gb_s": 1},
    },
}


# search.sync_fit and search.discrepancy_per_octave when a job writes none, by its device (see the estimator's
# docstring). GPUs: latent sync, as the step overlaps it (timing the all-reduce alone after a barrier
# perturbs the overlap), and the discrepancy that puts 60-75 % of the Pollux GPU traces' out-of-sample errors
# inside the 1-sigma band (bench/trace_accuracy.py, chosen there). CPUs: split parts (gloo's threads slow the
# compute they run beside, which the split fit measures) and the prior that the CPU benchmark was tuned with.
FIT_DEFAULTS = {
    "gpu": {"sync_fit": "latent", "discrepancy_per_octave": 0.08},
    "cpu": {"sync_fit": "split", "discrepancy_per_octave": 0.02},
}


def sync_device(gpus_per_node: int) -> str:
    """The SYNC_PRIORS preset of a job: NCCL's on GPUs, gloo's on CPUs."""
    return "gpu" if gpus_per_node > 0 else "cpu"
