"""The command line of bench/tula_bench/chaos_sites.py (its docstring: what it measures, how to run it)."""

from tula_bench.chaos_sites import main

if __name__ == "__main__":
    raise SystemExit(main())
