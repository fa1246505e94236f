# Checkpoints live in work/{job}/train/, never among the outputs: Snakemake deletes a failed job's outputs.
rule train:
    input:
        "results/{job}/selection.json",
    output:
        summary="results/{job}/train/summary.json",
        model="results/{job}/train/model.pt",
    params:
        settings=settings("model", "data", "train", "resources"),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/train.log",
    threads: chosen_nodes
    resources:
        timing_slot=1,
    shell:
        "tula-hpc train --job {wildcards.job} --selection {input}"
        " --out-dir results/{wildcards.job}/train > {log} 2>&1"
