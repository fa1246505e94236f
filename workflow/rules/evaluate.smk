rule evaluate:
    input:
        model="results/{job}/train/model.pt",
        summary="results/{job}/train/summary.json",
        selection="results/{job}/selection.json",
    output:
        "results/{job}/eval.json",
    params:
        settings=settings("data"),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/evaluate.log",
    shell:
        "tula-hpc evaluate --job {wildcards.job} --model {input.model}"
        " --summary {input.summary} --selection {input.selection} --out {output} > {log} 2>&1"
