"""The command line of bench/tula_bench/whole_run.py (its docstring: what it measures, how to run it)."""

from tula_bench.whole_run import main

if __name__ == "__main__":
    raise SystemExit(main())
