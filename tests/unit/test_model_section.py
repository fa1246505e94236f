"""model_section.py: the fitted model term by term, with which sync fit ran, the compute line's kinks, host counts
whose inter-node sync holds a level of its own and the interference, where the fit found them; then every candidate."""

from dataclasses import replace

from tests.unit.report_inputs import INPUTS
from tula_hpc.core.records import FitResult
from tula_hpc.reporting.model_section import model_section


def test_the_section_says_which_sync_fit_ran_where_compute_kinks_and_host_counts_with_their_own_sync():
    perfmodel = FitResult.from_dict(INPUTS["perfmodel"])
    assert "(split fit)" in model_section(INPUTS["plan"], perfmodel)
    assert "kinks" not in model_section(INPUTS["plan"], perfmodel)
    kinks = [{"per_device_batch": 32.0, "over_line": 1.0}, {"per_device_batch": 64.0, "over_line": 0.8}]
    perfmodel = replace(perfmodel, params={**perfmodel.params, "sync_fit": "latent", "compute_kinks": kinks})
    section = model_section(INPUTS["plan"], perfmodel)
    assert "latent: fitted with g to the overlapped steps alone" in section
    assert "(kinks): 1.00 at b = 32, 0.80 at b = 64" in section
    assert "its own level" not in section
    levels = [{"hosts": 2, "over_line": 1.91}]
    perfmodel = replace(perfmodel, params={**perfmodel.params, "inter_sync_levels": levels})
    assert "times its own level where a host count's profiles agree on one: 1.91 at 2 hosts" in model_section(
        INPUTS["plan"], perfmodel
    )
    assert "slower beside the all-reduce" not in model_section(INPUTS["plan"], perfmodel)
    perfmodel = replace(perfmodel, params={**perfmodel.params, "interference": 0.083})
    assert "multi-rank compute 8.3% slower beside the all-reduce (interference)" in model_section(
        INPUTS["plan"], perfmodel
    )


def test_every_candidate_follows_the_model_sorted_by_node_shape_and_batch():
    perfmodel = FitResult.from_dict(INPUTS["perfmodel"])
    section = model_section(INPUTS["plan"], perfmodel)
    fitted, candidates = section.split("### Every candidate\n")
    assert fitted.startswith("## Performance model (full search, 6 of 6 candidates profiled)")
    rows = [line for line in candidates.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [tuple(row.split(" | ")[i] for i in (0, 2)) for row in rows] == [
        ("| 1", "64"),
        ("| 1", "128"),
        ("| 1", "256"),
        ("| 2", "64"),
        ("| 2", "128"),
        ("| 2", "256"),
    ]
    assert "leave-one-out over 6 profiles: median 3.0%, max 8.0%" in fitted
