rule probe_memory:
    output:
        "results/{job}/memory.json",
    params:
        settings=settings(*STEP_SETTINGS),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/probe_memory.log",
    threads: 2  # probes run two at a time, a fresh process each
    shell:
        "tula-hpc probe-memory --job {wildcards.job} --out {output} > {log} 2>&1"
