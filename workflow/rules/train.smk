# Checkpoints live in work/{job}/train/, never among the outputs: Snakemake deletes a failed job's outputs.
rule train:
    input:
        "results/{job}/selection.json",
    output:
        summary="results/{job}/train/summary.json",
        model="results/{job}/train/model.pt",
    log:
        "logs/{job}/train.log",
    conda:
        "../../envs/tula-hpc.yaml"
    threads: chosen_nodes
    resources:
        timing_slot=1,
    params:
        settings=settings("train"),
    shell:
        "tula-hpc train --job {wildcards.job} --selection {input}"
        " --summary {output.summary} --model {output.model} > {log} 2>&1"
