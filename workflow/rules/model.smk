rule fit_model:
    input:
        plan="results/{job}/plan.json",
        memory="results/{job}/memory.json",
        # The planned profiles; for adaptive search its adaptive.json, which lists every profile it took.
        profiles=lambda wildcards: (
            f"results/{wildcards.job}/adaptive.json"
            if config["jobs"][wildcards.job]["search"]["mode"] == "adaptive"
            else planned_profiles(wildcards)
        ),
    output:
        "results/{job}/perfmodel.json",
    params:
        settings=settings("train", "search", "objective"),
    conda:
        "../../envs/tula-hpc.yaml"
    log:
        "logs/{job}/fit_model.log",
    shell:
        "tula-hpc fit-model --job {wildcards.job} --plan {input.plan} --memory {input.memory}"
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
