"""The command line of bench/tula_bench/goodput_replay.py (its docstring: what it measures, how to run it)."""

from tula_bench.goodput_replay import main

if __name__ == "__main__":
    raise SystemExit(main())
