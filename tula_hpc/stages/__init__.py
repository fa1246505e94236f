"""The nine stages, one module per `tula-hpc <stage>` (cli.py's STAGES), each a plain function taking paths and a
`main()`, and their common runner (runner.py: settings, errors, exit codes).

May import every folder and tula_hpc.config; a stage never imports another stage (the runner is not a stage).
"""
