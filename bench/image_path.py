"""The command line of bench/tula_bench/image_path.py (its docstring: what it measures, how to run it)."""

import sys

from tula_bench.image_path import main

if __name__ == "__main__":
    sys.exit(main())
