"""search_report.py: the report says which profiles confirmed the choice and why they stopped, what the search's
profiles cost against the grid's, and which configurations tied and by which rule; nothing where there was none."""

from tula_hpc.core.records import FitResult, Selection
from tula_hpc.reporting.search_section import search_section, tie_sentence

CONFIRM = {
    "objective": "time",
    "limit": 3,
    "band_sigmas": 2.0,
    "profiles": [
        {
            "nodes": 2,
            "batch": 256,
            "role": "best",
            "sigmas_behind": 0.0,
            "predicted_step_s": 0.05,
            "measured_step_s": 0.07,
        },
        {
            "nodes": 1,
            "batch": 256,
            "role": "rival",
            "sigmas_behind": 0.8,
            "predicted_step_s": 0.06,
            "measured_step_s": 0.06,
        },
    ],
    "stopped": "no unmeasured rival can still win within its band",
    "chosen": {"nodes": 1, "batch": 256},
}
PRICE = {"device_s": 12.0, "grid_device_s": 80.0, "share": 0.15}


def perfmodel(**search) -> FitResult:
    fields = dict.fromkeys(FitResult.__dataclass_fields__)
    return FitResult(**{**fields, "search": {"history": [], "stopped": None, **search}})


def test_the_confirming_profiles_their_stop_and_the_searchs_price_are_told():
    text = search_section(perfmodel(confirm=CONFIRM, price=PRICE))
    assert "The choice (time) was confirmed before it committed" in text and "at most 3 profiles" in text
    assert "| 2 | - | 256 | best | 0.00 | 0.05000 | 0.07000 |" in text
    assert "| 1 | - | 256 | rival | 0.80 | 0.06000 | 0.06000 |" in text
    assert "stopped: no unmeasured rival can still win within its band" in text
    assert "12.0 device-seconds" in text and "15% of what profiling all candidates would take" in text
    nothing = search_section(perfmodel(confirm={**CONFIRM, "profiles": []}))
    assert "It measured nothing more" in nothing
    assert search_section(perfmodel()) == ""  # a record made before confirming, or with search.confirm 0


def test_a_tie_names_the_tied_configurations_what_the_figure_alone_would_take_and_the_rule():
    tie = {
        "tied": [{"nodes": 2, "batch": 256}, {"nodes": 1, "batch": 256}],
        "best_by_figure": {"nodes": 2, "batch": 256},
        "chosen": {"nodes": 1, "batch": 256},
        "tie_sigmas": 0.5,
        "rule": "the fewest devices",
    }
    fields = dict.fromkeys(Selection.__dataclass_fields__)
    text = tie_sentence(Selection(**{**fields, "tie": tie}))
    assert text.startswith(" Tied within the noise (0.5 of their combined 1-sigma bands)")
    assert "2 node(s) B=256, 1 node(s) B=256" in text and "would take 2 node(s) B=256" in text
    assert text.endswith("Rule: the fewest devices.")
    assert tie_sentence(Selection(**fields)) == ""
