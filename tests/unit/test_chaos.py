"""bench/chaos.py's bookkeeping on synthetic trials and files with known answers (the faults need the cluster)."""

from __future__ import annotations

import json

import torch
from tula_bench import chaos


def test_the_summary_counts_what_was_lost_and_compares_weights_only_where_a_trial_resumed_alike():
    clean, lingering = {"alive_after_down": []}, {"alive_after_down": ["slurmd:12"]}
    done = {"moment": {"at_s": 9}, "completed": True, "resumed": True, "same_choice": True, "unreadable_files": []}
    done["slurm_cycle"] = clean
    trials = [
        {**done, "fault": "kill_rank", "bit_equal": True, "steps_repeated": 4},
        {**done, "fault": "kill_rank", "bit_equal": False, "unreadable_files": ["a"], "steps_repeated": 1},
        {**done, "fault": "node_down", "same_choice": False, "bit_equal": False, "steps_repeated": None},
        {**done, "fault": "node_down", "resumed": False, "bit_equal": True, "slurm_cycle": lingering},
        {"fault": "full_disk", "moment": None, "completed": False, "steps_repeated": 2, "slurm_cycle": clean},
    ]
    assert chaos.summarise(trials, seed=7) == {  # the seven keys, and no other
        "trials": 5,
        "completed": 4,
        "manual_steps": 1,
        "bad_files_accepted": 1,
        "steps_repeated_beyond_one": 3 + 0 + 1,  # each trial may compute the step its fault interrupted once more
        "bit_equal_share": 0.5,
        "seed": 7,
    }
    assert chaos.details(trials) == {
        "faults_landed": 4,
        "stuck_runs": 0,
        "steps_repeated": 7,
        "slurm_cycles_clean": 4,
        "by_fault": {
            "full_disk": {
                "trials": 1,
                "landed": 0,
                "completed": 0,
                "steps_repeated": 2,
                "bit_equal_of_same_choice": [0, 0],
            },
            "kill_rank": {
                "trials": 2,
                "landed": 2,
                "completed": 2,
                "steps_repeated": 5,
                "bit_equal_of_same_choice": [1, 2],
            },
            "node_down": {
                "trials": 2,
                "landed": 2,
                "completed": 2,
                "steps_repeated": 0,
                "bit_equal_of_same_choice": [1, 1],
            },
        },
    }


def test_steps_run_twice_are_counted_from_rank_0s_trace(tmp_path):
    workdir = tmp_path / "trial0"
    assert chaos.steps_repeated(workdir) is None  # training never started
    # steps 1-7, a kill, resumed from the checkpoint at step 5; a line the kill cut short is not a step
    chaos.trace_path(workdir).write_text("1\n2\n3\n4\n5\n6\n7\n6\n6\n7\n8\n")
    assert chaos.steps_repeated(workdir) == 3


def test_a_final_file_that_cannot_be_read_back_is_named(tmp_path):
    results = tmp_path / "results" / "job" / "train"
    results.mkdir(parents=True)
    (results / "summary.json").write_text(json.dumps({"epochs": 3}))
    (results.parent / "eval.json").write_text('{"test_accuracy": 0.9')  # cut short
    torch.save({"model": {}}, results / "model.pt")
    (results / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    assert sorted(chaos.unreadable(tmp_path, "job")) == [
        str(results.parent / "eval.json"),
        str(results / "checkpoint.pt"),
    ]


def test_each_fault_has_its_function_and_the_draws_replay_from_the_seed():
    assert sorted(chaos.FAULTS) == [
        "corrupt_checkpoint",
        "full_disk",
        "kill_driver",
        "kill_rank",
        "node_down",
        "restart_slurmctld",
        "scancel_stage",
    ]
    assert all(chaos.FAULTS[name].__name__ == name for name in chaos.FAULTS)
    drawn = chaos.draws(28, 40)
    assert drawn[:5] == chaos.draws(28, 5)  # a trial is replayed alone by its index
    assert {fault for _, fault, _ in drawn} == set(chaos.FAULTS)  # the default run meets every fault
    assert {job for job, _, _ in drawn} == set(chaos.JOBS)
    assert all(0 <= share < 1 for _, _, share in drawn)


def test_why_a_run_failed_is_read_from_its_part_of_the_driver_log_and_each_failed_rules_log(tmp_path):
    workdir = tmp_path / "trial0"
    (workdir / "logs" / "job").mkdir(parents=True)
    (workdir / "logs" / "job" / "probe_memory.log").write_text("probing\nRuntimeError: squeue failed\n")
    first = "Error in rule plan:\n    jobid: 2\n    log: logs/job/plan.log (check log file(s) for error details)\n"
    second = (
        "Error in rule probe_memory:\n    jobid: 1\n    log: logs/job/probe_memory.log (check log file(s))\n"
        "Shutting down, this might take some time.\n"
    )
    chaos.log_path(workdir).write_text(first + second)
    assert chaos.failures(workdir, since=0) == ["plan: (no log)", "probe_memory: RuntimeError: squeue failed"]
    assert chaos.failures(workdir, since=len(first)) == ["probe_memory: RuntimeError: squeue failed"]
    assert chaos.failures(workdir, since=len(first + second)) == []  # a killed driver wrote no error
