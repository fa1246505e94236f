"""The command line of bench/tula_bench/slurm_overhead.py (its docstring: what it measures, how to run it)."""

from tula_bench.slurm_overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
