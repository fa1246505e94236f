"""The report's memory-model section: memory.json's line near the largest batch, what its intercept and slope are
made of, which of the allocator's figures sized the batch, the card's limit where CUDA's trials bracketed it, and the
probes that were fitted. Apart from the stage so that the words for memory.json's fields have one home."""

from __future__ import annotations

from tula_hpc.reporting.figures import markdown_table

# The fixed parts of the memory model (memory.json's composition), in words.
FIXED_PARTS = {
    "parameters_and_buffers": "parameters and buffers",
    "optimizer_state": "optimiser state",
    "workspace": "workspace kept (cuBLAS, cuDNN)",
    "autocast_weight_copies": "autocast's weight copies",
    "ddp_buckets": "DDP buckets",
    "nccl_ring_buffers": "NCCL ring buffers (estimated)",
    "gradients_and_temporaries": "gradients and temporaries",
}


def _deciding_figure(memory: dict) -> str:
    """Which of the allocator's figures sized the batch, the other beside it, and on CUDA the limit the trials found."""
    allocated, reserved = memory["fit"], memory["fit_reserved"]
    if reserved == allocated:
        return "The allocator reserves what it allocates here, so one figure sizes the batch."
    batch = memory["max_batch_per_device"]

    def megabytes_at_batch(fit: dict) -> float:
        return (fit["intercept_bytes"] + fit["slope_bytes_per_sample"] * batch) / 1e6

    text = (
        f"The steps' allocated bytes size the batch: {megabytes_at_batch(allocated):.1f} MB allocated at batch "
        f"{batch}, for which the caching allocator reserved {megabytes_at_batch(reserved):.1f} MB in the probes "
        f"(its slack there follows what the card has spare, not the limit)."
    )
    if memory.get("beyond_index_cap"):
        text += (
            f" Above batch {memory['index_cap']} one tensor holds 2^31 elements or more, where CUDA kernels split the"
            " batch or index in 64 bits: the trials ran there, the probes did not."
        )
    return text + _card_limit(memory["limit"]) if memory.get("limit") else text


def _card_limit(limit: dict) -> str:
    """The limit CUDA's trials bracketed: both largest batches, and what the allocator could not give back."""
    failed = f", {limit['smallest_failed']} ran out of memory" if limit["smallest_failed"] else ""
    clean = limit["without_retry"]
    text = (
        f" On the card (allocator settings '{limit['cuda_alloc_conf'] or 'the defaults'}') the largest batch that ran "
        f"is {limit['limit']}{failed}; the largest whose steps needed no allocator retry "
        + (f"is {clean}" if clean else "was not seen among the trials")
        + " (a retry frees the cache and synchronises the device: it costs time every step)."
    )
    if limit["allowance_bytes"] is not None:
        text += f" The allocator could not give back {limit['allowance_bytes'] / 1e6:.1f} MB at its limit."
    return text + " The headroom comes off the largest batch that ran."


def _fixed(memory: dict) -> str:
    """The intercept's make-up (memory.json's composition): what the device holds whatever the batch."""
    parts = memory["composition"]["fixed_bytes"]
    return ", ".join(f"{FIXED_PARTS[name]} {size / 1e6:.2f} MB" for name, size in parts.items())


def _per_sample(memory: dict) -> str:
    """The slope's make-up (memory.json's composition): what Eq. 3 counts and the temporaries it leaves out."""
    parts = memory["composition"]["per_sample_bytes"]
    return ", ".join(f"{name.replace('_', ' ')} {size / 1e3:.2f} kB" for name, size in parts.items())


def memory_section(memory: dict) -> str:
    """The section, ending with the probes' table."""
    return f"""## Memory model
Peak device memory of a steady step near the largest batch = {memory["fit"]["intercept_bytes"] / 1e6:.2f} MB
+ {memory["fit"]["slope_bytes_per_sample"] / 1e3:.2f} kB x batch (parameters, optimiser state and DDP buckets included;
it prices memory-based cost), of which fixed {_fixed(memory)};
per sample {_per_sample(memory)}. {_deciding_figure(memory)} Device memory {
        memory["device_memory_bytes"] / 1e9:.2f} GB ({memory["device_memory_source"]}) with {memory["headroom"]:.0%}
headroom: largest per-device batch **{memory["max_batch_per_device"]}**{
        "" if memory["verified"] else " (no trial step confirmed it)"
    }.

{
        markdown_table(
            memory["probes"],
            [
                ("probe batch", "batch", "d"),
                ("outcome", "outcome", "s"),
                ("peak allocated (B)", "peak_bytes", "d"),
                ("peak reserved (B)", "reserved_peak_bytes", "d"),
                ("saved activations (B)", "activation_bytes", "d"),
                ("autocast weight copies (B)", "autocast_weight_bytes", "d"),
                ("gradients (B)", "grad_bytes", "d"),
                ("optimiser (B)", "optimizer_bytes", "d"),
                ("workspace (B)", "workspace_bytes", "d"),
            ],
        )
    }
"""
