"""The nine stages, one module per `tula-hpc <stage>` (the command's STAGES), each a plain function taking paths and a
`main()`: probe_memory.py, plan.py, profile.py, adapt.py, fit_model.py, select.py, train.py, evaluate.py and
report.py; and their common runner (runner.py: settings, errors, exit codes).

May import every folder and tula_hpc.config; a stage never imports another stage (the runner is not a stage).
"""
