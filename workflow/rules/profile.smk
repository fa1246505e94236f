rule profile:
    input:
        "results/{job}/plan.json",
    output:
        "results/{job}/profile/N{nodes}{gpus}_B{batch}.json",
    log:
        "logs/{job}/profile/N{nodes}{gpus}_B{batch}.log",
    conda:
        "../../envs/tula-hpc.yaml"
    threads: lambda wildcards: int(wildcards.nodes)
    resources:
        timing_slot=1,
    params:
        settings=settings("profile"),
        gpus=lambda wildcards: f"--gpus-per-node {wildcards.gpus.removeprefix('_G')}" if wildcards.gpus else "",
    shell:
        "tula-hpc profile --job {wildcards.job} --plan {input}"
        " --nodes {wildcards.nodes} {params.gpus} --batch {wildcards.batch} --out {output} > {log} 2>&1"


# The profiles beyond the plan: adaptive search's, from the planned (partial) profiles, one profile job at a time;
# then those that confirm the choice (search.confirm: the predicted best and the rivals that could still beat it).
# adaptive.json holds the profiles it added. Each is kept in work/{job}/adaptive/ as soon as it is measured, so a
# rerun after a kill reuses it instead of measuring again. `tula-hpc profile --adaptive` is the adapt stage's old
# command, kept as an alias (tula_hpc/cli.py): results made with it stay done, where a changed command reruns them.
rule adapt:
    input:
        plan="results/{job}/plan.json",
        memory="results/{job}/memory.json",
        profiles=planned_profiles,
    output:
        "results/{job}/adaptive.json",
    log:
        "logs/{job}/adapt.log",
    conda:
        "../../envs/tula-hpc.yaml"
    threads: lambda wildcards: config["jobs"][wildcards.job]["search"]["nodes"]["max"]
    resources:
        timing_slot=1,
    params:
        settings=settings("adapt"),
    shell:
        "tula-hpc profile --job {wildcards.job} --plan {input.plan} --adaptive --profiles {input.profiles}"
        " --memory {input.memory} --out {output} > {log} 2>&1"
