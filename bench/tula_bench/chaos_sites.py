"""Benchmark: bench/chaos.py's trials over the local cluster's site profiles (issue 56, "the fault benchmark gains
the site profiles"). `--profiles permissive,strict` (both by default): permissive is today's cluster; strict is a
site's (PreemptMode=CANCEL on partition debug with a preempting partition `urgent` on the same nodes, JobRequeue=0,
cores confined by cgroups, a QOS with a limit). Run as root, under flock /tmp/tula-cpu.lock, with nothing else using
the cluster; the bench starts it itself:

    python bench/chaos_sites.py                       # 40 trials over both profiles -> bench/results/chaos_sites.json
    python bench/chaos_sites.py --smoke --out /tmp/s.json   # one short trial per profile, the digits job only

The trials are spread over the profiles (in groups, one group a profile: the cluster is switched between groups by
down.sh and TULA_SLURM_SITE=<profile> up.sh) and over each profile's faults (chaos_site_faults.py: preemption that
cancels mid-training and mid-profile, a time limit reached with requeue off, an administrator's hold and release,
slurmctld restarted while a job pends and while one runs, results that show late), each fault's job and moment
drawn from the seed as bench/chaos.py draws them; faults that need the strict profile's settings are drawn under it
only (ONLY_UNDER). Each trial is bench/chaos.py's (chaos.trial: the same command again until the DAG completes,
its checks of lost work, bit-equal weights against an undisturbed run of the same job under the same profile, files
that cannot be read), and records the longest the run's logs (the driver's output and its stages' logs) did not grow
after the fault while the run went on. The result file opens with the issue's summary and is written after every
trial, so a bench stopped early keeps the trials it ran.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from tula_bench import chaos
from tula_bench.chaos_cluster import slurm_cycle, switch_site
from tula_bench.chaos_faults import our_jobs
from tula_bench.chaos_site_faults import (
    HOLD_S,
    LAG_S,
    SITE_FAULTS,
    TIME_LIMIT_CHANGES,
    URGENT_WAIT_S,
    profiling_job,
    training_job,
)
from tula_bench.common import bench_parser, merged, parse_bench_args, provenance, write_and_report
from tula_hpc.core.atomic_files import write_json

PROFILES = ("permissive", "strict")  # scripts/slurm/up.sh's site profiles
ONLY_UNDER = {  # faults that need a site's settings: a preempting partition, JobRequeue=0
    "preempt_cancel_train": ("strict",),
    "preempt_cancel_profile": ("strict",),
    "time_limit_requeue_off": ("strict",),
}
# Training must outlast the one-minute limit TIME_LIMIT_CHANGES sets, under confined cores: the job of that fault.
JOBS = {
    **chaos.JOBS,
    "fashion_mnist_long": merged(chaos.JOBS["fashion_mnist"], {"train": {"epochs": 6, "lr_milestones": [4]}}),
}
JOB_OF = {"time_limit_requeue_off": "fashion_mnist_long"}


def running(pick):
    """A fault's target: a running job of the run that `pick` (job name) chooses."""
    return lambda workdir, name: any(pick(workdir, name, job_name) for _, job_name in our_jobs(name))


SITE_TARGETS = {  # as chaos.TARGETS: what each fault needs before it can land
    "preempt_cancel_train": running(training_job),
    "preempt_cancel_profile": running(profiling_job),
    "time_limit_requeue_off": running(training_job),
    "admin_hold": lambda workdir, name: True,  # the fault makes a job pend itself
    "restart_slurmctld": chaos.some_job,
    "restart_slurmctld_pending": lambda workdir, name: True,
    "late_results": chaos.some_job,
}
SITES = chaos.Bench(JOBS, SITE_FAULTS, SITE_TARGETS, {"time_limit_requeue_off": TIME_LIMIT_CHANGES})


def faults_under(profile: str) -> list[str]:
    return sorted(fault for fault in SITE_FAULTS if profile in ONLY_UNDER.get(fault, (profile,)))


def draws(seed: int, trials: int, profiles: list[str], smoke: bool = False) -> list[tuple[str, str, str, float]]:
    """Each trial's profile, job, fault and moment, from the seed alone (a trial replays by its index): the trials
    in one group a profile, as even as they divide; in a group, faults in rounds, each a shuffle of the profile's
    kinds, so that every kind gets its share. A smoke run draws the digits job alone, and no fault of a job of its
    own (JOB_OF)."""
    rng, drawn = random.Random(seed), []
    for place, profile in enumerate(profiles):
        count = trials // len(profiles) + (place < trials % len(profiles))
        kinds = [fault for fault in faults_under(profile) if not (smoke and fault in JOB_OF)]
        group = []
        while len(group) < count:
            rng.shuffle(kinds)
            for fault in kinds:
                fashion = not smoke and rng.random() < chaos.FASHION_MNIST_SHARE
                job = JOB_OF.get(fault, "fashion_mnist" if fashion else "digits")
                group.append((profile, job, fault, rng.random()))
        drawn += group[:count]
    return drawn


def summarise(trials: list[dict], seed: int, profiles: list[str]) -> dict:
    """The issue's summary: chaos.py's figures over every profile, the longest a run said nothing after a fault,
    and the held jobs that ended CANCELLED before their release (a hold is the site's, never the run's to undo)."""
    silent = [t["silent_wait_s"] for t in trials if t.get("silent_wait_s") is not None]
    figures = chaos.summarise(trials, seed)
    return {
        "profiles": list(profiles),
        **{key: figures[key] for key in figures if key != "seed"},
        "longest_silent_wait_s": max(silent) if silent else None,
        "held_jobs_cancelled": sum(bool((t["moment"] or {}).get("held_cancelled")) for t in trials),
        "seed": seed,
    }


def details(trials: list[dict], profiles: list[str]) -> dict:
    """chaos.py's details, and each profile's own counts."""
    by_profile = {}
    for profile in profiles:
        of = [t for t in trials if t["profile"] == profile]
        silent = [t["silent_wait_s"] for t in of if t.get("silent_wait_s") is not None]
        by_profile[profile] = {
            "trials": len(of),
            "landed": sum(t["moment"] is not None for t in of),
            "completed": sum(t["completed"] for t in of),
            "longest_silent_wait_s": max(silent) if silent else None,
        }
    return {**chaos.details(trials), "by_profile": by_profile}


def profile_list(text: str) -> list[str]:
    """--profiles: names of scripts/slurm/up.sh's site profiles, comma-separated, each once."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(PROFILES) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"'{text}': name each of {', '.join(PROFILES)} at most once, with commas")
    return names


def report(result: dict) -> None:
    for t in result["trials"]:
        print(
            f"{t['index']:3d} {t['profile']:10s} {t['job']:18s} {t['fault']:25s} {json.dumps(t['moment'])}: "
            + (f"completed after {t['reruns']} rerun(s)" if t["completed"] else "NOT completed")
            + f", silent {t['silent_wait_s']} s, steps repeated {t['steps_repeated']}"
        )
    print(json.dumps(result["summary"], indent=1))
    print(json.dumps(result["details"]["by_profile"]))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "chaos_sites.json")
    parser.add_argument("--profiles", type=profile_list, default=list(PROFILES), help="comma-separated site profiles")
    parser.add_argument("--trials", type=int, default=40, help="in all, spread over the profiles")
    parser.add_argument("--seed", type=int, default=56)
    parser.add_argument("--only", type=int, nargs="+", help="replay these trials of the seed's draws alone")
    parser.add_argument("--reference-runs", type=int, default=chaos.REFERENCE_RUNS)
    parser.add_argument("--smoke", action="store_true", help="one trial a profile, the digits job, one reference run")
    args = parse_bench_args(parser, argv)
    trials_in_all = len(args.profiles) if args.smoke else args.trials
    drawn = draws(args.seed, trials_in_all, args.profiles, smoke=args.smoke)
    if args.only is not None and not set(args.only) <= set(range(len(drawn))):
        parser.error(f"--only: trial indices run from 0 to {len(drawn) - 1} (--trials {trials_in_all})")
    settings = {
        "profiles": args.profiles,
        "jobs": JOBS,
        "only_under": ONLY_UNDER,
        "job_of": JOB_OF,
        "faults": {profile: faults_under(profile) for profile in args.profiles},
        "time_limit_changes": TIME_LIMIT_CHANGES,
        "hold_s": HOLD_S,
        "lag_s": LAG_S,
        "urgent_wait_s": URGENT_WAIT_S,
        "max_reruns": chaos.MAX_RERUNS,
        "run_limit_s": chaos.RUN_LIMIT_S,
        "trials": trials_in_all,
        "only": args.only,
        "smoke": args.smoke,
        "reference_runs": 1 if args.smoke else args.reference_runs,
    }
    runs = Runs(settings, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for index in args.only if args.only is not None else range(len(drawn)):
            runs.trial(Path(tmp), index, *drawn[index])
            write_json(args.out, runs.result())  # kept should the bench stop
    return write_and_report(args.out, runs.result(), report)


class Runs:
    """The bench's trials so far, the undisturbed runs they compare with (one set per profile and job), and the
    cluster's profile: switched when a trial's differs."""

    def __init__(self, settings: dict, seed: int):
        self.settings, self.seed = settings, seed
        self.trials, self.references, self.switches, self.site = [], {}, [], None

    def trial(self, root: Path, index: int, profile: str, job: str, fault: str, share: float) -> None:
        if profile != self.site:
            self.switches.append({"before_trial": index, **switch_site(profile)})
            self.site = profile
        key = f"{profile}/{job}"
        if key not in self.references:
            self.references[key] = chaos.undisturbed(root / profile, job, self.settings["reference_runs"], SITES)
        record = chaos.trial(root / profile, index, job, fault, share, self.references[key], SITES)
        self.trials.append({"profile": profile, **record, "slurm_cycle": slurm_cycle()})

    def result(self) -> dict:
        profiles = self.settings["profiles"]
        return {
            "summary": summarise(self.trials, self.seed, profiles),
            "details": details(self.trials, profiles),
            "targets": {
                "trials": ">= 40",
                "completed": "every trial",
                "manual_steps": "0",
                "bad_files_accepted": "0",
                "steps_repeated_beyond_one": "0",
                "bit_equal_share": "1",
                "longest_silent_wait_s": "<= 300",
                "held_jobs_cancelled": "0",
            },
            "trials": self.trials,
            "undisturbed": {key: {k: v for k, v in r.items() if k != "weights"} for key, r in self.references.items()},
            "site_switches": self.switches,
            "provenance": provenance(),
            "settings": self.settings,
        }
