"""The command line of bench/tula_bench/gpu_check.py (its docstring: what it measures, how to run it)."""

from tula_bench.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
