rule fit_model:
    input:
        plan="results/{job}/plan.json",
        profiles=planned_profiles,
    output:
        "results/{job}/perfmodel.json",
    params:
        settings=settings("train", "objective"),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/fit_model.log",
    shell:
        "tula-hpc fit-model --job {wildcards.job} --plan {input.plan}"
        " --profiles {input.profiles} --out {output} > {log} 2>&1"


rule select:
    input:
        "results/{job}/perfmodel.json",
    output:
        "results/{job}/selection.json",
    params:
        settings=settings("objective"),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/select.log",
    shell:
        "tula-hpc select --job {wildcards.job} --perfmodel {input} --out {output} > {log} 2>&1"
