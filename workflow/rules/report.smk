rule report:
    input:
        "results/{job}/memory.json",
        "results/{job}/plan.json",
        "results/{job}/perfmodel.json",
        "results/{job}/selection.json",
        "results/{job}/train/summary.json",
        "results/{job}/eval.json",
    output:
        report="results/{job}/report.md",
        time="results/{job}/time_vs_batch.png",
        cost="results/{job}/cost_surface.png",
        accuracy="results/{job}/predicted_vs_measured.png",
        training="results/{job}/training.png",
    log:
        "logs/{job}/report.log",
    conda:
        "../../envs/tula-hpc.yaml"
    shell:
        "tula-hpc report --job {wildcards.job} --results-dir results/{wildcards.job}"
        " --out {output.report} > {log} 2>&1"
