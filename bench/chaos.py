"""The command line of bench/tula_bench/chaos.py (its docstring: what it measures, how to run it)."""

from tula_bench.chaos import main

if __name__ == "__main__":
    raise SystemExit(main())
