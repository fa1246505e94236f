"""The command line of bench/tula_bench/loader_pace.py (its docstring: what it measures, how to run it)."""

from tula_bench.loader_pace import main

if __name__ == "__main__":
    raise SystemExit(main())
