"""The report's performance-model section: the fitted step-time model term by term (data, compute with its kinks,
each kind of sync with whether the profiles fitted it, the overlap), its error, the search's account and the profiles,
then every candidate's prediction."""

from __future__ import annotations

from tula_hpc.core.records import FitResult
from tula_hpc.performance.sync_priors import SYNC_KINDS
from tula_hpc.reporting.figures import GPUS_COLUMN, markdown_table
from tula_hpc.reporting.plots import rows_by_shape
from tula_hpc.reporting.search_section import search_section

SYNC_FIT_TEXT = {
    "split": "fitted to each profile's all-reduce timed alone after a barrier (split fit)",
    "latent": "latent: fitted with g to the overlapped steps alone, as Pollux fits it (sync timed alone set aside)",
}


def _sync_terms(params: dict, identified: dict) -> str:
    """Each kind of sync's latency and time per byte, and whether the profiles fitted it or it is the job's prior."""

    def term(name: str, value: str) -> str:
        return f"{value} ({'fitted' if identified.get(name) else 'prior'})"

    return "; ".join(
        f"{kind.replace('_', '-')} "
        + term(f"{kind}_latency_s", f"{params[f'{kind}_latency_s'] * 1e6:.1f} us per hop")
        + " + "
        + term(f"{kind}_seconds_per_byte", f"{params[f'{kind}_seconds_per_byte'] * 1e9:.3f} s/GB moved")
        for kind in SYNC_KINDS
    )


def _inter_sync_levels(params: dict) -> str:
    """Host counts whose inter-node sync holds a level of its own (performance.collective_cost.inter_sync_levels);
    a perfmodel.json fitted before them holds none."""
    levels = params.get("inter_sync_levels", [])
    if not levels:
        return ""
    where = ", ".join(f"{level['over_line']:.2f} at {level['hosts']} hosts" for level in levels)
    return f"\n  inter-node part times its own level where a host count's profiles agree on one: {where}"


def _overlap(params: dict) -> str:
    """g, and what it means: the share of sync left exposed at the largest N's profiled batch extremes; and the
    interference of the all-reduce with the compute beside it, where fitted (a perfmodel.json fitted before it has
    none)."""
    shares = params["exposed_sync_share"]
    where = ", ".join(f"{s['share']:.0%} at b = {s['per_device_batch']}" for s in shares)
    interference = params.get("interference", 0.0)
    return (
        f"overlap g = {params['overlap_gamma']:.2f}"
        + (f" (exposed share of sync at N = {shares[0]['ranks']}: {where})" if shares else "")
        + (
            f"; multi-rank compute {interference:.1%} slower beside the all-reduce (interference)"
            if interference
            else ""
        )
    )


def _compute_kinks(params: dict) -> str:
    """The compute line's kinks, where the profiles show them (performance.kinks_predict_better)."""
    kinks = params["compute_kinks"]
    if not kinks:
        return ""
    where = ", ".join(f"{k['over_line']:.2f} at b = {k['per_device_batch']:g}" for k in kinks)
    return f"\n  times measured compute over that line at each profiled batch, interpolated (kinks): {where}"


def _throughput_columns(profiled: list[dict]) -> list[tuple[str, str, str]]:
    """A text job's profiles measured tokens per second beside samples (fit_model's rows); an image job's none."""
    if not all("tokens_per_s" in p for p in profiled):
        return []
    return [("samples/s", "samples_per_s", ".1f"), ("tokens/s", "tokens_per_s", ".0f")]


def _fitted_model(plan: dict, perfmodel: FitResult) -> str:
    p, identified = perfmodel.params, perfmodel.identified
    unidentified = [name for name, ok in identified.items() if not ok]
    loo = perfmodel.leave_one_out
    quality = (
        f"leave-one-out over {loo['count']} profiles: median {loo['median_rel_error']:.1%}, "
        f"max {loo['max_rel_error']:.1%}"
        if loo["count"]
        else "no leave-one-out estimate (the profiles exactly identify the model)"
    )
    notes = "".join(f"\n- {note}" for note in perfmodel.notes)
    return f"""## Performance model ({plan["mode"]} search, {len(perfmodel.profiled)} of {
        len(plan["candidates"])
    } candidates profiled)
t_step = data + (compute^g + sync^g)^(1/g) (g = 1: sync adds to compute; larger g hides more of it behind compute),
with b the per-device batch and h the ranks per host:
- data = {p["data_intercept_s"] * 1e3:.3f} ms + {p["data_per_sample_s"] * 1e6:.2f} us x b
- compute = {p["intercept_s"] * 1e3:.3f} ms + {p["per_sample_s"] * 1e6:.2f} us x (b - {p["batch_ref"]:g}) + (h - 1) x ({
        p["contention_s"] * 1e3:.3f} ms + {p["contention_per_sample_s"] * 1e6:.2f} us x (b - {p["batch_ref"]:g})){
        _compute_kinks(p)
    }
- sync ({perfmodel.collective}) = intra-node part among a host's h ranks + inter-node part among the hosts, {
        SYNC_FIT_TEXT[p["sync_fit"]]
    }:
  {_sync_terms(p, identified)}{_inter_sync_levels(p)}
- {_overlap(p)}

Not identified by these profiles: {", ".join(unidentified) if unidentified else "none"}.{notes}
Fit error on the profiles (RMS) {p["rms_rel_error"]:.1%}; {quality}. A profiled candidate's step below counts its own
measurement with weight {
        perfmodel.measurement_weight:.2f} against the model (its out-of-sample error against the profile noise).
{search_section(perfmodel)}
{
        markdown_table(
            perfmodel.profiled,
            [
                ("N", "nodes", "d"),
                ("B", "batch", "d"),
                ("measured step (s)", "measured_step_s", ".5f"),
                ("predicted step (s)", "predicted_step_s", ".5f"),
                ("step IQR/median", "step_iqr_over_median", ".1%"),
                ("interference", "interference", ".0%"),
                *_throughput_columns(perfmodel.profiled),
            ],
        )
    }"""


def _every_candidate(perfmodel: FitResult) -> str:
    candidates = [c for row in rows_by_shape(perfmodel.candidates).values() for c in row]
    return f"""### Every candidate
{
        markdown_table(
            candidates,
            [
                ("N", "nodes", "d"),
                *GPUS_COLUMN,
                ("B", "batch", "d"),
                ("b/device", "per_device_batch", "d"),
                ("step (s)", "step_s", ".5f"),
                ("+-", "rel_uncertainty", ".0%"),
                ("T (s)", "time_s", ".2f"),
                ("cost", "cost", ".5g"),
            ],
        )
    }"""


def model_section(plan: dict, perfmodel: FitResult) -> str:
    """The fitted model and every candidate's prediction (the section ends the report's body)."""
    return _fitted_model(plan, perfmodel) + "\n" + _every_candidate(perfmodel)
