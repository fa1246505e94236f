# tula-hpc: choose (nodes, batch) for each job in config/jobs.yaml, then train and report.
# Run: snakemake --profile profiles/local   (or profiles/slurm on a cluster login node)
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/jobs.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/memory.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/profile.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


onstart:
    record_driver()


onerror:
    release_measuring_allocations()


rule all:
    default_target: True
    input:
        expand("results/{job}/report.md", job=TARGETS),
