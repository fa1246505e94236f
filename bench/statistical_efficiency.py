"""The command line of bench/tula_bench/statistical_efficiency.py (its docstring: what it measures, how to run it)."""

from tula_bench.statistical_efficiency import main

if __name__ == "__main__":
    raise SystemExit(main())
