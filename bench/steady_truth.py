"""The command line of bench/tula_bench/steady_truth.py (its docstring: what it measures, how to run it)."""

from tula_bench.steady_truth import main

if __name__ == "__main__":
    main()
