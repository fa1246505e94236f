checkpoint plan:
    input:
        "results/{job}/memory.json",
    output:
        "results/{job}/plan.json",
    params:
        settings=settings("search", "resources"),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/plan.log",
    shell:
        "tula-hpc plan --job {wildcards.job} --memory {input} --out {output} > {log} 2>&1"
