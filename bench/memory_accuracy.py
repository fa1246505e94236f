"""The command line of bench/tula_bench/memory_accuracy.py (its docstring: what it measures, how to run it)."""

from tula_bench.memory_accuracy import main

if __name__ == "__main__":
    main()
