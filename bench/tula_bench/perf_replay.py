"""bench/perf_accuracy.py's replay: each round of one model's measurements plays a profiling campaign (each search's
profiles stand in for profile jobs), judged against the median of the other rounds (see perf_accuracy's docstring)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from tula_hpc.performance.search_modes import SECOND_BATCHES as RULES  # partial search's second batch at the largest N

if TYPE_CHECKING:
    from tula_hpc.core.job import Job, ObjectiveSettings

MEASUREMENT = {"warmup_steps": 2, "steps": 4, "min_measure_s": 1.0, "max_attempts": 3, "interference_tolerance": 0.1}
OBJECTIVES = ("time", "cost", "knee")
RULED = tuple(f"{mode}/{rule}" for mode in ("partial", "adaptive") for rule in RULES)  # searches under one rule
SEARCHES = RULED + ("full",)

# Costs are node-hours (the bench jobs' pricing), which read no memory.json; pricing.costs prices every
# pricing model at once, so it gets a zero memory line for the one this bench does not use.
NO_MEMORY = {"fit": {"intercept_bytes": 0, "slope_bytes_per_sample": 0}}


def _key(c: dict) -> tuple[int, int]:
    return c["nodes"], c["batch"]


def disturbed(record: dict) -> bool:
    return record["interference"] > MEASUREMENT["interference_tolerance"]


def _rel(predicted: float, measured: float) -> float:
    return float(abs(predicted / measured - 1))


def stage_prediction(job: Job, profiles: list[dict], candidates: list[dict], train_samples: int, settings: dict):
    """T and cost of every candidate as the fit_model stage computes them from these profiles."""
    from tula_hpc.performance.prediction import fit_and_predict

    return fit_and_predict(job, profiles, candidates, train_samples, NO_MEMORY, settings)[3]


def regrets(
    predicted: list[dict], measured: list[dict], objective: ObjectiveSettings, recipe_batch: int
) -> dict[str, float]:
    """Per objective: what the select stage's choice on the prediction measures, against its choice on the truth."""
    from tula_hpc.performance.choice import select

    truth = {_key(c): c for c in measured}
    found = {}
    for goal in OBJECTIVES:
        wanted = dataclasses.replace(objective, minimize=goal)
        chosen = select(predicted, objective.pricing, wanted, recipe_batch)["chosen"]
        best = select(measured, objective.pricing, wanted, recipe_batch)["chosen"]
        field = "cost" if goal == "cost" else "time_s"
        regret = truth[_key(chosen)][field] / best[field] - 1
        found[f"{goal}_regret"] = abs(regret) if goal == "knee" else regret
    return found


class ModelReplay:
    """One model's rounds of measurements replayed: each round's profiles stand in for profile jobs, and the median
    of the other rounds (their quiet measurements where there are any) is the truth they are judged against."""

    def __init__(self, name: str, job: Job, candidates: list[dict], records: list[dict], train_samples: int):
        from tula_hpc.core.run_layout import devices_per_node
        from tula_hpc.performance.fitting import model_params

        self.name, self.job, self.candidates, self.train_samples = name, job, candidates, train_samples
        self.devices, self.launcher = devices_per_node(job), job.launcher
        self.rounds = sorted({r["round"] for r in records})
        self.by_round = {r: {_key(x): x for x in records if x["round"] == r} for r in self.rounds}
        self.settings = model_params(job)

    def row(self, c: dict) -> list[float]:
        from tula_hpc.performance.fitting import candidate_row

        return candidate_row(c, self.devices, self.launcher)

    def truth(self, c: dict, excluded: int) -> float:
        others = [self.by_round[r][_key(c)] for r in self.rounds if r != excluded]
        quiet = [x for x in others if not disturbed(x)] or others
        return statistics.median(x["median"]["step_s"] for x in quiet)

    def measured_run(self, excluded: int) -> list[dict]:
        """T and cost of every candidate from its true step (weight 1: the model only scales the last step), known
        exactly (no band: the truth's best is its figure's, no tie)."""
        from tula_hpc.performance.fitting import fit_profiles
        from tula_hpc.performance.prediction import predict_candidates

        elsewhere = [x for r in self.rounds if r != excluded for x in self.by_round[r].values()]
        steps = {(c["nodes"] * self.devices, c["per_device_batch"]): self.truth(c, excluded) for c in self.candidates}
        model = fit_profiles(elsewhere, **self.settings)
        rows = predict_candidates(model, self.candidates, self.job, self.train_samples, NO_MEMORY, steps, 1.0)
        return [{**row, "rel_uncertainty": 0.0} for row in rows]

    def where(self, c: dict, r: int) -> dict:
        return {"model": self.name, "round": r, "nodes": c["nodes"], "batch": c["batch"]}

    def searches(self, current: int) -> tuple[dict[str, list[dict]], dict[str, dict]]:
        """What each search (SEARCHES) profiles in round `current`, and the model settings it fits with."""
        from tula_hpc.performance.search_modes import adaptive_search, planned

        candidates, devices, launcher, settings = self.candidates, self.devices, self.launcher, self.settings
        adaptive_settings = self.job.search.adaptive
        used = {"full": planned("full", candidates, devices, launcher)}
        fit_settings = {"full": settings}
        for rule in RULES:
            used[f"partial/{rule}"] = planned("partial", candidates, devices, launcher, second_batch=rule)
            fit_settings[f"partial/{rule}"] = settings
            adaptive = adaptive_search(
                candidates,
                planned("adaptive", candidates, devices, launcher, second_batch=rule),
                lambda c: self.by_round[current][_key(c)],
                self.row,
                settings,
                adaptive_settings.tolerance,
                adaptive_settings.max_profiles,
            )
            used[f"adaptive/{rule}"] = adaptive["profiled"]
            fit_settings[f"adaptive/{rule}"] = {
                **settings,
                "discrepancy_per_octave": adaptive["discrepancy_per_octave"],
            }
        return used, fit_settings

    def errors(self, current: int, search: str, chosen: list[dict]) -> list[dict]:
        """Step-time errors of the configurations `search` did not profile (full: leave-one-out)."""
        from tula_hpc.performance.fitting import fit_profiles

        measure = self.by_round[current]
        if search == "full":
            judged = self.candidates
            steps = [
                fit_profiles([measure[_key(c)] for c in judged if c is not held], **self.settings).predict(
                    [self.row(held)]
                )[0]
                for held in judged
            ]
        else:  # adaptive search that profiled everything leaves nothing unseen to judge
            judged = [c for c in self.candidates if c not in chosen]
            model = fit_profiles([measure[_key(c)] for c in chosen], **self.settings)
            steps = model.predict([self.row(c) for c in judged]) if judged else []
        return [
            {**self.where(c, current), "error": _rel(step, self.truth(c, current))} for c, step in zip(judged, steps)
        ]

    def campaign(self, current: int, chosen: list[dict], fit_settings: dict, measured: list[dict]) -> dict:
        """A search's profiling cost in round `current` and the regrets of the choice its profiles lead to."""
        measure = self.by_round[current]
        full_cost = sum(measure[_key(c)]["measure_wall_s"] * c["nodes"] for c in self.candidates)
        predicted = stage_prediction(
            self.job, [measure[_key(c)] for c in chosen], self.candidates, self.train_samples, fit_settings
        )
        cost = sum(measure[_key(c)]["measure_wall_s"] * c["nodes"] for c in chosen)
        return {
            "model": self.name,
            "round": current,
            "profiled": len(chosen),
            "cost_s": cost,
            "cost_share": cost / full_cost,
            **regrets(predicted, measured, self.job.objective, self.job.train.lr_base_batch),
        }

    def noise(self) -> list[dict]:
        """Every measurement's distance from the truth."""
        return [
            {
                **self.where(c, r),
                "error": _rel(self.by_round[r][_key(c)]["median"]["step_s"], self.truth(c, r)),
                "disturbed": disturbed(self.by_round[r][_key(c)]),
            }
            for r in self.rounds
            for c in self.candidates
        ]


def evaluate_model(name: str, job: Job, candidates: list[dict], records: list[dict], train_samples: int) -> dict:
    """One model's raw figures, each labelled with where it comes from: step-time errors per search (SEARCHES),
    one campaign (profiling cost, regrets) per search and round, and every measurement's distance from the truth."""
    replay = ModelReplay(name, job, candidates, records, train_samples)
    errors: dict[str, list[dict]] = {search: [] for search in SEARCHES}
    campaigns: dict[str, list[dict]] = {search: [] for search in SEARCHES}
    for current in replay.rounds:
        used, fit_settings = replay.searches(current)
        for search, chosen in used.items():
            errors[search] += replay.errors(current, search, chosen)
        measured = replay.measured_run(current)
        for search, chosen in used.items():
            campaigns[search].append(replay.campaign(current, chosen, fit_settings[search], measured))
    return {
        "configs": len(candidates),
        "rounds": len(replay.rounds),
        "errors": errors,
        "campaigns": campaigns,
        "noise": replay.noise(),
    }
