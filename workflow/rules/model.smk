rule fit_model:
    input:
        plan="results/{job}/plan.json",
        memory="results/{job}/memory.json",
        profiles=planned_profiles,
        # Only when the search mode adds profiles (tula_hpc.performance.search_modes): the profiles adaptive search took.
        adaptive=adaptive_manifest,
    output:
        "results/{job}/perfmodel.json",
    log:
        "logs/{job}/fit_model.log",
    conda:
        "../../envs/tula-hpc.yaml"
    params:
        settings=settings("fit_model"),
        adaptive=lambda wildcards, input: f"--adaptive {input.adaptive}" if input.adaptive else "",
    shell:
        "tula-hpc fit-model --job {wildcards.job} --plan {input.plan} --memory {input.memory}"
        " --profiles {input.profiles} {params.adaptive} --out {output} > {log} 2>&1"


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
        settings=settings("select"),
    shell:
        "tula-hpc select --job {wildcards.job} --perfmodel {input} --out {output} > {log} 2>&1"
