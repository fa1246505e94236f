# Checkpoints live in work/{job}/train/, never among the outputs: Snakemake deletes a failed job's outputs.
rule train:
    input:
        selection="results/{job}/selection.json",
        perfmodel=batch_schedule_model,
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
        perfmodel=lambda wildcards, input: f"--perfmodel {input.perfmodel}" if input.perfmodel else "",
    shell:
        "tula-hpc train --job {wildcards.job} --selection {input.selection} {params.perfmodel}"
        " --summary {output.summary} --model {output.model} > {log} 2>&1"
