"""The command line of bench/tula_bench/max_batch_search.py (its docstring: what it measures, how to run it)."""

from tula_bench.max_batch_search import main

if __name__ == "__main__":
    main()
