rule probe_memory:
    output:
        "results/{job}/memory.json",
    params:
        settings=settings("model", "data", "train", "resources"),
    log:
        "logs/{job}/probe_memory.log",
    threads: 1
    shell:
        "{PYTHON} -m tula_hpc.memory {STAGE_ARGS} --job {wildcards.job} --out {output} > {log} 2>&1"
