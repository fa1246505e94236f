"""The command line of bench/tula_bench/adaptive_fmnist.py (its docstring: what it measures, how to run it)."""

from tula_bench.adaptive_fmnist import main

if __name__ == "__main__":
    raise SystemExit(main())
