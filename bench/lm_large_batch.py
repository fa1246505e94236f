"""The command line of bench/tula_bench/lm_large_batch.py (its docstring: what it measures, how to run it)."""

from tula_bench.lm_large_batch import main

if __name__ == "__main__":
    raise SystemExit(main())
