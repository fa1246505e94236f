"""memory_section.py: memory.json's line and its make-up in words, which allocator figure sized the batch, the card's
limit where CUDA's trials bracketed it, and the probes' table."""

from tests.unit.report_inputs import INPUTS
from tula_hpc.reporting.memory_section import memory_section


def test_the_section_gives_the_line_its_make_up_the_deciding_figure_and_the_cards_limit():
    text = memory_section(INPUTS["memory"])
    assert text.startswith("## Memory model\nPeak device memory of a steady step near the largest batch = 20.00 MB")
    assert "of which fixed parameters and buffers 1.00 MB, optimiser state 1.00 MB" in text
    assert "35.4 MB allocated at batch 512, for which the caching allocator reserved 36.9 MB" in text
    assert "the largest batch that ran is 530, 535 ran out of memory" in text
    assert "(allocator settings 'expandable_segments:True')" in text
    assert "largest per-device batch **512**." in text
    assert text.endswith("| 64 | measured | 21920000 | 22984000 | 1920000 | 500000 | 1000000 | 1000000 | 4000000 |\n\n")


def test_one_figure_where_the_allocator_reserves_what_it_allocates_and_the_index_cap_where_trials_ran_above_it():
    memory = {**INPUTS["memory"], "fit_reserved": INPUTS["memory"]["fit"], "verified": False}
    text = memory_section(memory)
    assert "reserves what it allocates here, so one figure sizes the batch" in text
    assert "(no trial step confirmed it)" in text and "On the card" not in text
    limit = {**INPUTS["memory"]["limit"], "smallest_failed": None, "without_retry": None, "allowance_bytes": None}
    text = memory_section({**INPUTS["memory"], "limit": limit, "beyond_index_cap": True, "index_cap": 256})
    assert "Above batch 256 one tensor holds 2^31 elements or more" in text
    assert "is 530; the largest whose steps needed no allocator retry was not seen among the trials" in text
    assert "could not give back" not in text
