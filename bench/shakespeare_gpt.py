"""The command line of bench/tula_bench/shakespeare_gpt.py (its docstring: what it measures, how to run it)."""

from tula_bench.shakespeare_gpt import main

if __name__ == "__main__":
    raise SystemExit(main())
