rule report:
    input:
        memory="results/{job}/memory.json",
        plan="results/{job}/plan.json",
        perfmodel="results/{job}/perfmodel.json",
        selection="results/{job}/selection.json",
        summary="results/{job}/train/summary.json",
        evaluation="results/{job}/eval.json",
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
        "tula-hpc report --job {wildcards.job} --memory {input.memory} --plan {input.plan}"
        " --perfmodel {input.perfmodel} --selection {input.selection} --summary {input.summary}"
        " --eval {input.evaluation} --out {output.report} --time-plot {output.time} --cost-plot {output.cost}"
        " --accuracy-plot {output.accuracy} --training-plot {output.training} > {log} 2>&1"
