"""The benchmarks\x27 shared code: every measuring function, each script in bench/ calling one main()."""
