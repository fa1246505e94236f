rule profile:
    input:
        "results/{job}/plan.json",
    output:
        "results/{job}/profile/N{nodes}_B{batch}.json",
    params:
        settings=settings("model", "data", "train", "search", "resources"),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/profile/N{nodes}_B{batch}.log",
    threads: lambda wildcards: int(wildcards.nodes)
    resources:
        timing_slot=1,
    shell:
        "tula-hpc profile --job {wildcards.job} --plan {input}"
        " --nodes {wildcards.nodes} --batch {wildcards.batch} --out {output} > {log} 2>&1"
