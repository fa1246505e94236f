"""The command line of bench/tula_bench/generalization.py (its docstring: what it measures, how to run it)."""

from tula_bench.generalization import main

if __name__ == "__main__":
    main()
