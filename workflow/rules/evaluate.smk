rule evaluate:
    input:
        model="results/{job}/train/model.pt",
        summary="results/{job}/train/summary.json",
        selection="results/{job}/selection.json",
        memory="results/{job}/memory.json",
    output:
        "results/{job}/eval.json",
    log:
        "logs/{job}/evaluate.log",
    conda:
        "../../envs/tula-hpc.yaml"
    params:
        settings=settings("evaluate"),
    shell:
        "tula-hpc evaluate --job {wildcards.job} --model {input.model}"
        " --summary {input.summary} --selection {input.selection} --memory {input.memory}"
        " --out {output} > {log} 2>&1"
