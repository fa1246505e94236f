"""How long a run said nothing, on known moments of growth and on a file that grows under watch."""

from __future__ import annotations

import time

from tula_bench.log_silence import growth_times, longest_silence


def test_the_longest_silence_is_read_over_the_span_that_matters_only():
    grew = [100.0, 103.0, 110.0, 111.0, 140.0]
    assert longest_silence(grew, begin=102.0, end=120.0) == 9.0  # 111 -> 120: silent until the run ended
    assert longest_silence(grew, begin=100.0, end=145.0) == 29.0  # 111 -> 140
    assert longest_silence(grew, begin=141.0, end=141.5) == 0.5  # nothing grew in it at all
    assert longest_silence(grew, begin=150.0, end=149.0) == 0.0  # a run that ended as the fault landed


def test_each_growth_of_the_watched_size_is_noted_while_the_block_runs(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("")
    with growth_times(lambda: log.stat().st_size, poll_s=0.01) as grew:
        for noted, line in enumerate(("a\n", "b\n"), start=2):
            log.write_text(log.read_text() + line)
            deadline = time.time() + 10  # however loaded the machine, the watcher sees it in the end
            while len(grew) < noted and time.time() < deadline:
                time.sleep(0.01)
    assert len(grew) == 3 and grew == sorted(grew)  # the start, then each write
    log.write_text("more\n")
    time.sleep(0.05)
    assert len(grew) == 3  # the watch ended with the block
