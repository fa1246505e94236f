"""Search modes (paper III-A-2): which candidates are profiled, decided here and nowhere else.

- partial: the fewest extreme configurations that identify every coefficient of the performance model,
  the largest configuration among them by default (`partial_set`): 3 to 5 of them (6 over several GPUs per
  node), whatever the size of the grid. The fit reads their profiles.
- full: every candidate. The fit reads their profiles.
- adaptive (`adaptive_search`): starts from partial; the `adapt` rule (the adapt stage, stages/adapt.py) then
  adds the candidate the fitted model is least sure about until its uncertainty, calibrated on those very
  profiles, is small. The fit reads the partial profiles and adaptive.json, which holds the profiles it added.
- confirming the decision (`confirm_choice`, search.confirm profiles at most, partial and adaptive): after the
  fit, the adapt rule measures the predicted best configuration for the job's objective and constraints and the
  rivals that could still beat it within the noise (choice.contenders), refitting after each. A better fit alone
  does not make a better choice on GPU traces (see `partial_set`: a 2-node sync profile made the fit worse), and
  adaptive search spends its profiles where the model is unsure, not where the decision is; the decision needs
  measuring. adaptive.json holds these profiles too.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from tula_hpc.core.run_layout import configuration
from tula_hpc.performance.choice import CONFIRM_BAND_SIGMAS, contenders, sigmas_behind

MODES = ("partial", "full", "adaptive")
SECOND_BATCHES = ("largest", "middle")
# Adaptive search stops on predictions only after this many profiles it added were predicted (never on one).
VALIDATIONS = 2


def _unknown(mode: str) -> ValueError:
    return ValueError(f"unknown search mode {mode!r}; allowed: {', '.join(MODES)}")


def planned(
    mode: str, grid: list[dict], devices_per_node: int, launcher: str, second_batch: str = "largest"
) -> list[dict]:
    """The candidates the plan profiles before the first fit."""
    if mode == "partial":
        return partial_set(grid, devices_per_node, launcher, second_batch)
    if mode == "full":
        return grid
    if mode == "adaptive":
        return partial_set(grid, devices_per_node, launcher, second_batch)
    raise _unknown(mode)


def adds_profiles(mode: str, confirm: int = 0) -> bool:
    """Whether the search profiles beyond the plan (the adapt rule: adaptive search, or `confirm` profiles that
    confirm partial search's choice), so the fit also reads adaptive.json."""
    if mode == "full":
        return False
    if mode == "partial":
        return confirm > 0
    if mode == "adaptive":
        return True
    raise _unknown(mode)


def partial_set(grid: list[dict], devices_per_node: int, launcher: str, second_batch: str = "largest") -> list[dict]:
    """The fewest extreme candidates that identify every coefficient the grid can identify.

    Both batch extremes at the smallest N fit the compute line; the smallest batch at the largest N adds
    sync. A second batch at the largest N tells how the overlap grows with the batch (the performance
    model's g) and, where ranks share hosts differently across N (the local launcher), the per-sample
    contention: `second_batch` "largest" takes the largest one, the configuration the time objective
    usually picks, so it is measured rather than extrapolated to; "middle" the one nearest the geometric
    middle of its range (ties to the smaller), at a fraction of the largest's cost (about 1/8 for per-device
    batches 8 to 512), leaving the largest configurations extrapolated. A second size of the sync that N
    changes, at its smallest batch, separates its latency from its bandwidth: the sync among all ranks on
    the local launcher (one host), among the hosts on a cluster (within a node it is the same size at every N).
    That size is the one nearest the geometric middle of the sizes that sync (`_middle_size`), not the smallest:
    on the Pollux GPU traces (bench/trace_accuracy.py) 2-node syncs are slower than 3- and 4-node ones, and a
    second size at 2 nodes took partial search's median error from 6.8 % to 10.2 % and its largest from 57 % to
    121 %.
    A grid of several GPUs per node is `_node_shapes_set`'s.
    """
    if second_batch not in SECOND_BATCHES:
        raise ValueError(f"unknown second batch {second_batch!r}; allowed: {', '.join(SECOND_BATCHES)}")
    if len({c.get("gpus_per_node") for c in grid}) > 1:
        return _node_shapes_set(grid, second_batch)
    by_nodes: dict[int, list[dict]] = {}
    for c in sorted(grid, key=lambda c: (c["nodes"], c["batch"])):
        by_nodes.setdefault(c["nodes"], []).append(c)
    smallest, largest = min(by_nodes), max(by_nodes)
    chosen = [by_nodes[smallest][0], by_nodes[smallest][-1], by_nodes[largest][0]]
    if largest != smallest and len(by_nodes[largest]) > 1:  # the largest N spans several ranks: it syncs
        chosen.append(_second_batch(by_nodes[largest], second_batch))
    multi_rank = [n for n in by_nodes if (n * devices_per_node if launcher == "local" else n) > 1]
    if len({n for n in (smallest, largest) if n in multi_rank}) < 2 and len(multi_rank) >= 2:
        chosen.append(by_nodes[_middle_size(multi_rank, (smallest, largest))][0])
    return _distinct(chosen)


def _middle_size(sizes: list[int], taken) -> int:
    """The size nearest the geometric middle of `sizes`' range, other than those `taken` (ties to the smaller)."""
    middle = (math.log2(min(sizes)) + math.log2(max(sizes))) / 2
    return min((n for n in sizes if n not in taken), key=lambda n: (abs(math.log2(n) - middle), n))


def _second_batch(row: list[dict], second_batch: str) -> dict:
    """The batch beyond a row's smallest that tells how the overlap grows with it (see `partial_set`)."""
    first, *rest = row
    if second_batch == "largest":
        return rest[-1]
    middle = (math.log2(first["per_device_batch"]) + math.log2(rest[-1]["per_device_batch"])) / 2
    return min(rest, key=lambda c: abs(math.log2(c["per_device_batch"]) - middle))


def _distinct(chosen: list[dict]) -> list[dict]:
    """Each pick once, in order: on a small grid several extremes are the same candidate."""
    return [c for i, c in enumerate(chosen) if c not in chosen[:i]]


def _node_shapes_set(grid: list[dict], second_batch: str) -> list[dict]:
    """Partial search over node shapes (several GPUs per node g): each term of the model from the profiles that hold it.

    Compute from the smallest node at the fewest GPUs (one rank where the grid has it), at both batch extremes;
    intra-node sync from the smallest node at the most GPUs, whose ranks share one host, and at a GPU count
    between (a second size separates its latency from its bandwidth); inter-node sync at two host counts, the
    largest N and the one nearest the middle of those of at least 2 (`_middle_size`), at the most GPUs; the
    overlap's growth with the batch from a second batch at the largest N. Each at its smallest batch unless
    said otherwise; a shape the grid lacks (no batch splits evenly over its ranks) is skipped.
    """
    rows: dict[tuple[int, int], list[dict]] = {}
    for c in sorted(grid, key=lambda c: (c["nodes"], c["gpus_per_node"], c["batch"])):
        rows.setdefault((c["nodes"], c["gpus_per_node"]), []).append(c)
    fewest, most = min(g for _, g in rows), max(g for _, g in rows)
    nodes_at = {g: sorted(n for n, h in rows if h == g) for g in (fewest, most)}
    compute = rows[(nodes_at[fewest][0], fewest)]
    smallest = nodes_at[most][0]
    chosen = [compute[0], compute[-1], rows[(smallest, most)][0]]
    between = [g for n, g in rows if n == smallest and fewest < g < most]
    if between:
        chosen.append(rows[(smallest, _middle_size([fewest, *between, most], (fewest, most)))][0])
    spanning = [n for n in nodes_at[most] if n >= 2]
    if spanning:
        largest = rows[(spanning[-1], most)]
        chosen.append(largest[0])
        if len(spanning) > 1:
            chosen.append(rows[(_middle_size(spanning, (spanning[-1],)), most)][0])
        if len(largest) > 1:
            chosen.append(_second_batch(largest, second_batch))
    return _distinct(chosen)


def discrepancy_estimate(history: list[dict], prior: float) -> float:
    """Model error per octave from each adaptive step's out-of-sample error, shrunk toward the prior.

    The prior counts as one observation, so a single lucky prediction cannot end the search.
    """
    ratios = [h["rel_error"] / h["octaves"] for h in history if h["octaves"] > 0]
    return math.sqrt((prior**2 + sum(r**2 for r in ratios)) / (1 + len(ratios)))


def adaptive_search(
    candidates: list[dict],
    initial: list[dict],
    measure,
    row_of,
    settings: dict,
    tolerance: float,
    max_profiles: int | None = None,
) -> dict:
    """Profile `initial`, then keep adding the candidate with the largest predicted uncertainty.

    Before each new profile joins the fit, the current model predicts it: that out-of-sample error
    calibrates the model's discrepancy per octave, so the uncertainty is measured, not assumed. Stops,
    once VALIDATIONS profiles were added, when every unprofiled candidate's uncertainty is within
    `tolerance`; or when the last VALIDATIONS profiles, each the least certain candidate of its turn, were
    all predicted within `tolerance` (on a machine noisier than the tolerance the uncertainty itself never
    gets there); at `max_profiles`; or when nothing is left. `measure(candidate)` returns a profile record;
    `row_of(candidate)` its input row (`candidate_row`).
    """
    # Imported here: the fit brings scikit-learn, a second of the start of every stage that plans with this module.
    from tula_hpc.performance.fitting import fit_profiles

    profiled = [dict(c) for c in initial]
    profiles = [measure(c) for c in profiled]
    history: list[dict] = []
    prior = settings["discrepancy_per_octave"]
    discrepancy = prior
    while True:
        model = fit_profiles(profiles, **{**settings, "discrepancy_per_octave": discrepancy})
        remaining = [c for c in candidates if c not in profiled]
        if not remaining:
            stopped = "every candidate profiled"
            break
        if max_profiles is not None and len(profiles) >= max_profiles:
            stopped = f"reached max_profiles ({max_profiles})"
            break
        X = np.array([row_of(c) for c in remaining], float)
        uncertainty = model.predict_uncertainty(X)
        worst = int(np.argmax(uncertainty))
        # An uncertainty fewer than VALIDATIONS added profiles have tested is mostly the prior: one lucky
        # prediction would end the search on it.
        if len(history) >= VALIDATIONS and uncertainty[worst] <= tolerance:
            stopped = f"largest predicted uncertainty {uncertainty[worst]:.1%} <= tolerance {tolerance:.1%}"
            break
        recent = history[-VALIDATIONS:]
        if len(recent) == VALIDATIONS and all(h["rel_error"] <= tolerance for h in recent):
            stopped = f"the last {VALIDATIONS} profiles were predicted within tolerance {tolerance:.1%}"
            break
        candidate = remaining[worst]
        predicted = float(model.predict(X[worst : worst + 1])[0])
        octaves = float(model.octaves_to_profiled(X[worst : worst + 1])[0])
        profile = measure(candidate)
        measured = profile["median"]["step_s"]
        history.append(
            {
                "nodes": candidate["nodes"],
                "batch": candidate["batch"],
                "uncertainty": float(uncertainty[worst]),
                "predicted_step_s": predicted,
                "measured_step_s": measured,
                "rel_error": abs(predicted / measured - 1),
                "octaves": octaves,
            }
        )
        discrepancy = discrepancy_estimate(history, prior)
        profiled.append(candidate)
        profiles.append(profile)
    return {
        "profiled": profiled,
        "profiles": profiles,
        "history": history,
        "discrepancy_per_octave": discrepancy,
        "stopped": stopped,
    }


def confirm_choice(
    profiles: list[dict],
    measure,
    predict,
    decide,
    limit: int,
    band_sigmas: float = CONFIRM_BAND_SIGMAS,
) -> dict:
    """Measure what could still change the decision before it commits: at most `limit` profiles beyond `profiles`.

    Each turn `predict(profiles)` gives every candidate's figures from a fit to the profiles so far (with
    `rel_uncertainty` and whether it was `profiled`) and `decide(rows)` the choice (choice.decide); the first of
    its contenders is measured (`measure(candidate)` returns a profile record): the predicted best where it is
    unmeasured, then the rival likeliest to beat it, so that where they differ in node count both are measured.
    Stops when no unmeasured rival can still win within `band_sigmas` of their combined band, or at `limit`.
    """
    profiles = list(profiles)
    confirmed: list[dict] = []
    measured: list[dict] = []
    while True:
        rows = predict(profiles)
        decision = decide(rows)
        goal = decision["goal"]
        waiting = [c for c in contenders(decision["pool"], goal, band_sigmas) if configuration(c) not in measured]
        if not waiting:
            stopped = "no unmeasured rival can still win within its band"
            break
        if len(confirmed) >= limit:
            stopped = f"reached search.confirm ({limit}) with {len(waiting)} rival(s) unmeasured"
            break
        candidate, best = waiting[0], decision["pool"][0]
        profile = measure(candidate)
        measured.append(configuration(candidate))
        confirmed.append(
            {
                **configuration(candidate),
                "role": "best" if candidate is best else "rival",
                "sigmas_behind": 0.0 if candidate is best else float(sigmas_behind(candidate, best, goal)),
                "predicted_step_s": candidate["step_s"],
                "measured_step_s": profile["median"]["step_s"],
            }
        )
        profiles.append(profile)
    return {
        "profiles": profiles,
        "confirmed": confirmed,
        "stopped": stopped,
        "limit": limit,
        "band_sigmas": band_sigmas,
        "rows": rows,
        "decision": decision,
    }


def search_price(profiles: list[dict], grid: list[dict]) -> dict:
    """Device-seconds the search's profiles took (each one's ranks x its measuring wall time: warm-up and measured
    steps, start-up not counted) against profiling every candidate of `grid` (rows with `ranks` and `step_s`) at
    the same wall time per step (the profiles' median), and the share."""
    spent = sum(p["world_size"] * p["measure_wall_s"] for p in profiles)
    steps_worth = statistics.median(p["measure_wall_s"] / p["median"]["step_s"] for p in profiles)
    whole = sum(row["ranks"] * row["step_s"] for row in grid) * steps_worth
    return {"device_s": spent, "grid_device_s": whole, "share": spent / whole if whole > 0 else None}
