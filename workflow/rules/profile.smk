rule profile:
    input:
        "results/{job}/plan.json",
    output:
        "results/{job}/profile/N{nodes}_B{batch}.json",
    params:
        settings=settings("model", "data", "train", "search", "resources"),
    log:
        "logs/{job}/profile/N{nodes}_B{batch}.log",
    threads: lambda wildcards: int(wildcards.nodes)
    resources:
        timing_slot=1,
    shell:
        "{PYTHON} -m tula_hpc.profiling {STAGE_ARGS} --job {wildcards.job} --plan {input}"
        " --nodes {wildcards.nodes} --batch {wildcards.batch} --out {output} > {log} 2>&1"
