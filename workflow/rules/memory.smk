rule probe_memory:
    output:
        "results/{job}/memory.json",
    log:
        "logs/{job}/probe_memory.log",
    conda:
        "../../envs/tula-hpc.yaml"
    threads: 2  # probes run two at a time, a fresh process each
    params:
        settings=settings("probe_memory"),
    shell:
        "tula-hpc probe-memory --job {wildcards.job} --out {output} > {log} 2>&1"
