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
    log:
        "logs/{job}/fit_model.log",
    conda:
        "../../envs/tula-hpc.yaml"
    params:
        settings=settings("train", "search", "objective"),
    shell:
        "tula-hpc fit-model --job {wildcards.job} --plan {input.plan} --memory {input.memory}"
        " --profiles {input.profiles} --out {output} > {log} 2>&1"


rule select:
    input:
        "results/{job}/perfmodel.json",
    output:
        "results/{job}/selection.json",
    log:
        "logs/{job}/select.log",
    conda:
        "../../envs/tula-hpc.yaml"
    params:
        settings=settings("objective"),
    shell:
        "tula-hpc select --job {wildcards.job} --perfmodel {input} --out {output} > {log} 2>&1"
