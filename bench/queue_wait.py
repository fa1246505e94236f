"""The command line of bench/tula_bench/queue_wait.py (its docstring: what it measures, how to run it)."""

from tula_bench.queue_wait import main

if __name__ == "__main__":
    raise SystemExit(main())
