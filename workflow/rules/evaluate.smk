rule evaluate:
    input:
        model="results/{job}/train/model.pt",
        summary="results/{job}/train/summary.json",
        selection="results/{job}/selection.json",
    output:
        "results/{job}/eval.json",
    params:
        settings=settings("data"),
    log:
        "logs/{job}/evaluate.log",
    shell:
        "{PYTHON} -m tula_hpc.evaluate {STAGE_ARGS} --job {wildcards.job} --model {input.model}"
        " --summary {input.summary} --selection {input.selection} --out {output} > {log} 2>&1"
