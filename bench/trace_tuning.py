"""The command line of bench/tula_bench/trace_tuning.py (its docstring: what it measures, how to run it)."""

from tula_bench.trace_tuning import main

if __name__ == "__main__":
    raise SystemExit(main())
