checkpoint plan:
    input:
        "results/{job}/memory.json",
    output:
        "results/{job}/plan.json",
    log:
        "logs/{job}/plan.log",
    conda:
        "../../envs/tula-hpc.yaml"
    params:
        settings=settings("plan"),
    shell:
        "tula-hpc plan --job {wildcards.job} --memory {input} --out {output} > {log} 2>&1"
