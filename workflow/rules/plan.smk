checkpoint plan:
    input:
        "results/{job}/memory.json",
    output:
        "results/{job}/plan.json",
    params:
        settings=settings("search", "resources"),
    log:
        "logs/{job}/plan.log",
    shell:
        "{PYTHON} -m tula_hpc.plan {STAGE_ARGS} --job {wildcards.job} --memory {input} --out {output} > {log} 2>&1"
