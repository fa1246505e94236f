"""bench/chaos_sites.py's bookkeeping on synthetic trials with known answers, its draws and its command line (the
faults themselves need the cluster)."""

from __future__ import annotations

import pytest
from tula_bench import chaos, chaos_sites
from tula_bench.chaos_site_faults import SITE_FAULTS, TIME_LIMIT_CHANGES
from tula_bench.common import bench_config, merged


def trial(profile: str, fault: str, **figures) -> dict:
    done = {"moment": {"at_s": 9}, "completed": True, "resumed": True, "same_choice": True, "bit_equal": True}
    return {"profile": profile, "fault": fault, **done, "unreadable_files": [], "steps_repeated": 1, **figures}


def test_the_summary_holds_the_issues_keys_over_every_profile():
    trials = [
        trial("permissive", "late_results", silent_wait_s=12.5),
        trial("permissive", "admin_hold", moment={"at_s": 3, "held_cancelled": False}, silent_wait_s=40.0),
        trial("strict", "admin_hold", moment={"at_s": 5, "held_cancelled": True}, silent_wait_s=301.2),
        trial("strict", "preempt_cancel_train", bit_equal=False, steps_repeated=3, silent_wait_s=None),
        {"profile": "strict", "fault": "time_limit_requeue_off", "moment": None, "completed": False},  # as recorded
    ]
    summary = chaos_sites.summarise(trials, seed=56, profiles=["permissive", "strict"])
    assert list(summary) == [  # the issue's keys, in its order, then the seed
        "profiles",
        "trials",
        "completed",
        "manual_steps",
        "bad_files_accepted",
        "steps_repeated_beyond_one",
        "bit_equal_share",
        "longest_silent_wait_s",
        "held_jobs_cancelled",
        "seed",
    ]
    assert summary == {
        "profiles": ["permissive", "strict"],
        "trials": 5,
        "completed": 4,
        "manual_steps": 1,
        "bad_files_accepted": 0,
        "steps_repeated_beyond_one": 2,  # the one trial that computed 3 steps twice, beyond the one it may
        "bit_equal_share": 0.75,  # 3 of the 4 completed trials that resumed alike
        "longest_silent_wait_s": 301.2,
        "held_jobs_cancelled": 1,
        "seed": 56,
    }
    by_profile = chaos_sites.details(trials, ["permissive", "strict"])["by_profile"]
    assert by_profile == {
        "permissive": {"trials": 2, "landed": 2, "completed": 2, "longest_silent_wait_s": 40.0},
        "strict": {"trials": 3, "landed": 2, "completed": 2, "longest_silent_wait_s": 301.2},
    }


def test_no_trial_yet_gives_a_summary_without_figures():
    summary = chaos_sites.summarise([], seed=1, profiles=["strict"])
    assert summary["trials"] == 0 and summary["held_jobs_cancelled"] == 0
    assert summary["longest_silent_wait_s"] is None and summary["bit_equal_share"] is None


def test_the_draws_spread_trials_over_profiles_in_groups_and_over_each_profiles_faults_from_the_seed():
    drawn = chaos_sites.draws(56, 41, ["permissive", "strict"])
    assert drawn == chaos_sites.draws(56, 41, ["permissive", "strict"])  # a trial replays by its index
    profiles = [profile for profile, _, _, _ in drawn]
    assert profiles == ["permissive"] * 21 + ["strict"] * 20  # one group a profile: one switch between them
    for profile in ("permissive", "strict"):
        faults = [fault for p, _, fault, _ in drawn if p == profile]
        assert set(faults) == set(chaos_sites.faults_under(profile))  # every kind the profile allows
    assert set(chaos_sites.faults_under("strict")) == set(SITE_FAULTS)
    assert not set(chaos_sites.faults_under("permissive")) & set(chaos_sites.ONLY_UNDER)  # no urgent partition there
    assert all(job == "fashion_mnist_long" for _, job, fault, _ in drawn if fault == "time_limit_requeue_off")
    assert all(0 <= share < 1 for *_, share in drawn)


def test_a_smoke_run_draws_one_short_trial_a_profile():
    drawn = chaos_sites.draws(56, 2, ["permissive", "strict"], smoke=True)
    assert [(profile, job) for profile, job, _, _ in drawn] == [("permissive", "digits"), ("strict", "digits")]
    assert not {fault for _, _, fault, _ in drawn} & set(chaos_sites.JOB_OF)


def test_each_site_fault_has_its_function_and_target():
    assert set(chaos_sites.SITE_TARGETS) == set(SITE_FAULTS)
    assert all(SITE_FAULTS[name].__name__ == name for name in SITE_FAULTS)
    assert set(chaos.JOBS) < set(chaos_sites.JOBS) and set(chaos_sites.JOB_OF.values()) <= set(chaos_sites.JOBS)


def test_every_trials_jobs_file_is_valid_the_time_limited_one_included():
    for job, sections in chaos_sites.JOBS.items():
        config = bench_config(as_name="c000000", **merged(sections, TIME_LIMIT_CHANGES))
        resources = config["jobs"]["c000000"]["resources"]
        assert (resources["time_limit"], resources["time_min"]) == ("fixed", 1), job


def test_the_profiles_option_names_known_profiles_once_each():
    assert chaos_sites.profile_list("strict, permissive") == ["strict", "permissive"]
    for bad in ("strict,lax", "strict,strict", ""):
        with pytest.raises(Exception, match="permissive, strict"):
            chaos_sites.profile_list(bad)


def test_a_smoke_run_names_its_out_and_only_replays_trials_that_exist(capsys):
    with pytest.raises(SystemExit):
        chaos_sites.main(["--smoke"])
    assert "--smoke needs --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chaos_sites.main(["--trials", "4", "--only", "4"])
    assert "--only: trial indices run from 0 to 3" in capsys.readouterr().err
