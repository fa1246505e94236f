"""The choice among predicted candidates: the feasible configuration that minimises time, cost or goodput's time
to progress, or sits at the knee of time vs batch; ties within the noise; the rivals that could still beat it.

One home for the decision, read by the select stage (stages/select.py) and by the search that confirms its decision
before it commits (search.confirm_choice, in the adapt rule).

A configuration is a node shape (N nodes of g GPUs each; 4 x 1 and 2 x 2 are different ones) and a global batch.

A candidate whose time, cost or the goal's figure is NaN or infinite (a prediction that could not be made) takes no
part: NaN compares false both ways, so it would meet every constraint and win or lose by chance; the selection names
it instead.

Constraints (all optional): at most `max_nodes` nodes, a global batch of at most `max_batch`, predicted
time T within `deadline_s` and cost C within `budget`. When no candidate meets them the choice fails with
the closest candidates and which constraint each breaks, by how much.

Two knees are reported. Kneedle (kneed, as in the paper) on the best time per global batch; it
normalises both axes, so for t(B) = a/B + c its answer depends only on the sampled range of B. The
model-based knee is the smallest B from which every further doubling saves less than `knee_min_saving`
of the time. `knee_method` says which one the knee objective follows.

Noise. Each candidate's figure (time, cost, time to progress) carries its relative 1-sigma band
(`rel_uncertainty`: the model's where it extrapolates, about the profile noise where the candidate was measured).
Two candidates *tie* when their figures differ by at most TIE_SIGMAS of their combined band (0: only equal
figures, see the constants' comment); among the
configurations tied with the best the choice follows TIE_RULE. A rival *can still win* when its figure lies within
CONFIRM_BAND_SIGMAS of their combined band of the best's (`contenders`), and so can the best one node count down
(`node_step_rival`): the search measures those before it commits. Both constants were chosen on one of the two
tuned GPU traces and judged on the other, both ways (bench/trace_tuning.py; issue 41's closing note).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tula_hpc.core.errors import StageError
from tula_hpc.core.run_layout import configuration, node_shape

if TYPE_CHECKING:
    from tula_hpc.core.job import ObjectiveSettings

RUNNERS_UP = 5
# What selection.json keeps of each runner-up; gpus_per_node where the plan made it a choice.
RUNNER_UP_FIELDS = (
    "nodes",
    "gpus_per_node",
    "batch",
    "per_device_batch",
    "time_s",
    "cost",
    "rel_uncertainty",
    "progress_time_s",
    "progress_cost",
    "wait_s",
    "profiled",
)
CLOSEST_SHOWN = 3
# constraint key -> (candidate field, unit shown in messages)
CONSTRAINTS = {
    "max_nodes": ("nodes", ""),
    "max_batch": ("batch", ""),
    "deadline_s": ("time_s", " s"),
    "budget": ("cost", ""),
}
# Chosen out of fold on the Pollux traces (bench/trace_tuning.py, with the performance model's interference term),
# among settings that meet the search cost's and the knee's targets. K and the band: ImageNet's best at tie 0 (K=3,
# band 1; K=4 with tie 0.5 overall), judged on CIFAR-10, time regret 0.4 % mean / 2.8 % worst, cost 1.0 % / 2.9 %, the
# knee found in every replay; CIFAR-10's own choice, K=2, finds ImageNet's knee in 75 % of the replays (target 90 %),
# so its fold cannot win. Both folds chose a band of one sigma: a wider one measures more rivals, and the noisiest
# measurement of them tends to win. The tie: the folds differ (0 on CIFAR-10, 0.5 on ImageNet, by 0.1 in a score of
# 1.5), and on the measured CPU profiles (bench/perf_accuracy.py) half a band raised the worst regrets (partial
# search's time regret 0 to 7.6 %, adaptive's cost regret 3.3 to 12.2 %): configurations within the noise of each
# other still lie along a trend the tie rule's preferences run against. So only equal figures tie.
TIE_SIGMAS = 0.0
CONFIRM_BAND_SIGMAS = 1.0
TIE_RULE = (
    "among configurations tied with the best (within the tie band of their combined noise), the fewest devices "
    "(nodes x GPUs per node: the allocation spent per hour, and no step across nodes the profiles did not need), "
    "then the global batch nearest the recipe's (train.lr_base_batch: the least large-batch risk), then the figure"
)


class InfeasibleError(StageError):
    """No candidate meets the constraints; the message lists the closest ones and what each breaks."""


def best_time_per_batch(candidates: list[dict]) -> list[dict]:
    """The fastest candidate at each global batch, whatever its node shape: the curve both knees read."""
    best: dict[int, dict] = {}
    for c in candidates:
        if c["batch"] not in best or c["time_s"] < best[c["batch"]]["time_s"]:
            best[c["batch"]] = c
    return [best[b] for b in sorted(best)]


def kneedle_knee(curve: list[dict]) -> int | None:
    times = [c["time_s"] for c in curve]
    if len(curve) < 3 or max(times) == min(times):  # no curve, no knee
        return None
    # Imported here: kneed brings scipy.signal, 1.5 s of the plan stage's 2.1 s start, and only a choice needs it.
    from kneed import KneeLocator

    knee = KneeLocator([c["batch"] for c in curve], times, curve="convex", direction="decreasing").knee
    return None if knee is None else int(knee)


def model_knee(curve: list[dict], min_saving: float) -> int:
    """Smallest batch from which every further doubling saves less than `min_saving` of the time."""
    for i, c in enumerate(curve):
        later = curve[i + 1 :]
        if all((prev["time_s"] - nxt["time_s"]) / prev["time_s"] < min_saving for prev, nxt in zip([c] + later, later)):
            return c["batch"]
    return curve[-1]["batch"]


def violations(candidate: dict, objective: ObjectiveSettings) -> dict[str, float]:
    """Each broken constraint with its relative excess (0.25 = 25 % over the limit)."""
    broken = {}
    for key, (field, _) in CONSTRAINTS.items():
        limit = getattr(objective, key)
        if limit is not None and candidate[field] > limit:
            broken[key] = candidate[field] / limit - 1 if limit > 0 else float("inf")
    return broken


def _describe(candidate: dict, objective: ObjectiveSettings) -> str:
    parts = []
    for key, excess in violations(candidate, objective).items():
        field, unit = CONSTRAINTS[key]
        parts.append(
            f"{field} {candidate[field]:.6g}{unit} > {key} {getattr(objective, key):.6g}{unit} (+{excess:.0%})"
        )
    return f"{node_shape(candidate, 'N={}')}, B={candidate['batch']}: " + "; ".join(parts)


# goal -> (the figure it minimises, the tie-breaker, whether the wait in the queue adds to it); the goodput goals
# count the steps a batch needs to make the recipe's progress at the measured noise scale (prediction.to_progress),
# the others the recipe's epochs. With objective.queue estimate the time goals minimise the time to result. The knee
# compares the node shapes at its batch by time.
GOALS = {
    "time": ("time_s", "cost", True),
    "cost": ("cost", "time_s", False),
    "goodput": ("progress_time_s", "progress_cost", True),
    "goodput_cost": ("progress_cost", "progress_time_s", False),
    "knee": ("time_s", "cost", False),
}
GOODPUT_GOALS = ("goodput", "goodput_cost")  # the goals that train to the recipe's progress, not its epochs


def _value(candidate: dict, goal: str) -> float:
    """The figure `goal` minimises, with the wait in the queue where it counts."""
    first, _, waits = GOALS[goal]
    return candidate[first] + (candidate.get("wait_s", 0.0) if waits else 0.0)


def combined_band(a: dict, b: dict, goal: str) -> float:
    """The 1-sigma band of the difference of two candidates' figures (their own bands, independent)."""
    first = GOALS[goal][0]
    return math.hypot(a[first] * a.get("rel_uncertainty", 0.0), b[first] * b.get("rel_uncertainty", 0.0))


def sigmas_behind(rival: dict, best: dict, goal: str) -> float:
    """How far `rival`'s figure lies behind the best's, in their combined band (inf where neither has noise)."""
    gap = _value(rival, goal) - _value(best, goal)
    band = combined_band(rival, best, goal)
    return gap / band if band > 0 else (math.inf if gap > 0 else 0.0)


def unpredicted_figures(candidate: dict, goal: str) -> list[str]:
    """The figures a choice by `goal` reads (time and cost, which the constraints and the knee's curve read, the
    goal's own, the wait) that `candidate` holds as NaN or infinite: a prediction that could not be made. NaN compares
    false both ways, so such a candidate would meet every constraint and win or be passed over by chance."""
    figures = dict.fromkeys(("time_s", "cost", *GOALS.get(goal, ())[:2], "wait_s"))
    return [name for name in figures if name in candidate and not math.isfinite(candidate[name])]


def _pool(feasible: list[dict], curve: list[dict], goal: str, knee: int) -> list[dict]:
    """The candidates `goal` compares by its figure, best first: all feasible ones, or the knee's batch's."""
    if goal not in GOALS:
        raise StageError(f"field 'objective.minimize': unknown goal {goal!r}; allowed: {', '.join(GOALS)}")
    first, second, _ = GOALS[goal]
    if any(first not in c for c in feasible):
        raise StageError(
            f"field 'objective.minimize': {goal} needs the gradient noise scale, which multi-rank profiles "
            f"measure, and perfmodel.json holds none; allowed: profile a configuration of 2 ranks or more "
            f"(search.nodes, search.gpus_per_node), or minimize time, cost or knee"
        )
    compared = [c for c in feasible if c["batch"] == knee] if goal == "knee" else feasible
    return sorted(compared, key=lambda c: (_value(c, goal), c[second]))


def _ranked(feasible: list[dict], pool: list[dict], goal: str, knee: int) -> list[dict]:
    """Every feasible candidate in the goal's order: the pool, then (for the knee) the rest by batch distance."""
    rest = sorted(
        (c for c in feasible if c not in pool),
        key=lambda c: (abs(c["batch"].bit_length() - knee.bit_length()), c["time_s"]),
    )
    return pool + rest


def tied(pool: list[dict], goal: str, tie_sigmas: float) -> list[dict]:
    """The configurations whose figure lies within `tie_sigmas` of their combined band of the best's."""
    best = pool[0]
    return [c for c in pool if sigmas_behind(c, best, goal) <= tie_sigmas]


def tie_break(ties: list[dict], recipe_batch: int, goal: str) -> dict:
    """TIE_RULE's pick among tied configurations."""
    return min(
        ties,
        key=lambda c: (
            c["nodes"] * (c.get("gpus_per_node") or 1),
            abs(math.log2(c["batch"] / recipe_batch)),
            _value(c, goal),
        ),
    )


def contenders(pool: list[dict], goal: str, band_sigmas: float = CONFIRM_BAND_SIGMAS) -> list[dict]:
    """The unmeasured configurations that can still win: the best where it is unmeasured, then every rival within
    `band_sigmas` of their combined band of the best's, the most likely to win first, then `node_step_rival`."""
    best = pool[0]
    rivals = [c for c in pool[1:] if sigmas_behind(c, best, goal) <= band_sigmas]
    rivals.sort(key=lambda c: sigmas_behind(c, best, goal))
    if not any(c["nodes"] != best["nodes"] for c in rivals):
        rivals += node_step_rival(pool)
    return [c for c in [best, *rivals] if not c.get("profiled", False)]


def node_step_rival(pool: list[dict]) -> list[dict]:
    """The best configuration one node count down from the best's (up where it has the fewest): a rival whatever
    its band. The worst choices on GPU traces of models nobody tuned for were all a step in node count the model
    believed in, a sync across nodes it took for cheap (issue 41); only measuring both sides of the step tells."""
    best = pool[0]
    fewer = [c["nodes"] for c in pool if c["nodes"] < best["nodes"]]
    more = [c["nodes"] for c in pool if c["nodes"] > best["nodes"]]
    if not fewer and not more:
        return []
    nodes = max(fewer) if fewer else min(more)
    return [next(c for c in pool if c["nodes"] == nodes)]


def decide(
    candidates: list[dict],
    objective: ObjectiveSettings,
    recipe_batch: int,
    tie_sigmas: float = TIE_SIGMAS,
) -> dict:
    """The choice among predicted candidates, with what it compared (`pool`, best first by the figure), the tie it
    broke and the candidates left out because a figure could not be predicted (`unpredicted`, naming the figures);
    raises InfeasibleError when no candidate meets the constraints, StageError when none could be predicted."""
    if not candidates:
        raise StageError("perfmodel.json has no candidates to choose from")
    goal = objective.minimize
    figures = [unpredicted_figures(c, goal) for c in candidates]
    unpredicted = [{**configuration(c), "figures": f} for c, f in zip(candidates, figures) if f]
    predicted = [c for c, f in zip(candidates, figures) if not f]
    if not predicted:
        raise StageError(
            "no candidate's figures could be predicted (NaN or infinite): "
            + " | ".join(f"{node_shape(u, 'N={}')}, B={u['batch']}: {', '.join(u['figures'])}" for u in unpredicted)
        )
    feasible = [c for c in predicted if not violations(c, objective)]
    if not feasible:
        closest = sorted(predicted, key=lambda c: (sum(violations(c, objective).values()), c["time_s"]))[:CLOSEST_SHOWN]
        raise InfeasibleError(
            "no candidate meets the constraints; closest: " + " | ".join(_describe(c, objective) for c in closest)
        )
    curve = best_time_per_batch(feasible)
    knees = {"kneedle": kneedle_knee(curve), "model": model_knee(curve, objective.knee_min_saving)}
    # Kneedle finds no knee on a curve without one (e.g. still falling steeply): the model knee stands in.
    knee_used = objective.knee_method if knees[objective.knee_method] is not None else "model"
    pool = _pool(feasible, curve, goal, knees[knee_used])
    ties = tied(pool, goal, tie_sigmas)
    chosen = tie_break(ties, recipe_batch, goal)
    ranked = _ranked(feasible, pool, goal, knees[knee_used])
    ranked.remove(chosen)
    return {
        "goal": goal,
        "chosen": chosen,
        "pool": pool,
        "ranked": [chosen, *ranked],
        "tie": _tie_record(ties, pool[0], chosen, tie_sigmas) if len(ties) > 1 else None,
        "feasible": feasible,
        "curve": curve,
        "knees": knees,
        "knee_used": knee_used,
        "unpredicted": unpredicted,
    }


def _tie_record(ties: list[dict], best: dict, chosen: dict, tie_sigmas: float) -> dict:
    """What selection.json and the report say of a tie: who tied, which the figure alone would take, the rule."""
    return {
        "tied": [configuration(c) for c in ties],
        "best_by_figure": configuration(best),
        "chosen": configuration(chosen),
        "tie_sigmas": tie_sigmas,
        "rule": TIE_RULE,
    }


def select(candidates: list[dict], pricing: str, objective: ObjectiveSettings, recipe_batch: int) -> dict:
    """The choice among perfmodel.json's `candidates` (priced by `pricing`): selection.json's fields but the job's
    name and the prediction of the run. `recipe_batch`: train.lr_base_batch, for ties."""
    decision = decide(candidates, objective, recipe_batch)
    ranked = decision["ranked"]
    return {
        "objective": objective.minimize,
        "pricing": pricing,
        "knee_method": objective.knee_method,
        "knee_min_saving": objective.knee_min_saving,
        "chosen": decision["chosen"],
        "knees": decision["knees"],
        "knee_used": decision["knee_used"],
        "tie": decision["tie"],
        "unpredicted": decision["unpredicted"] or None,
        "runners_up": [{k: c[k] for k in RUNNER_UP_FIELDS if k in c} for c in ranked[1 : 1 + RUNNERS_UP]],
        "constraints": {key: getattr(objective, key) for key in CONSTRAINTS},
        "feasible": len(decision["feasible"]),
        "candidates": len(candidates),
        "best_time_curve": [
            {k: c[k] for k in ("batch", "nodes", "gpus_per_node", "time_s") if k in c} for c in decision["curve"]
        ],
    }
