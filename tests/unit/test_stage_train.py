"""stages/train.py's choice of batch schedule: none under fixed, the ramp from the job over the selection's ranks,
adaptive's only with the fitted model's candidates, and clear errors naming the field."""

import pytest

from tests.conftest import default_job
from tula_hpc.core.errors import StageError
from tula_hpc.performance.batch_schedule import BatchRamp
from tula_hpc.stages.train import batch_schedule_for

CHOSEN = {"nodes": 2, "gpus_per_node": 0, "batch": 128}


def test_a_fixed_batch_has_no_schedule_and_a_ramp_ends_at_the_selected_batch():
    assert batch_schedule_for(default_job(), None, CHOSEN, ranks=2) is None
    ramp = batch_schedule_for(default_job(train={"batch_schedule": "ramp"}), None, CHOSEN, ranks=2)
    assert ramp == BatchRamp(start_batch=128, end_batch=128, fraction=0.2)  # lr_base_batch 128: nothing to ramp
    ramp = batch_schedule_for(
        default_job(train={"batch_schedule": "ramp", "ramp": {"start_batch": 16, "fraction": 0.3}}), None, CHOSEN, 2
    )
    assert (ramp.batches(), ramp.fraction, ramp.start(128)) == ([16, 32, 64, 128], 0.3, 16)


def test_a_ramp_that_cannot_split_over_the_ranks_or_adaptive_without_candidates_is_a_stage_error():
    uneven = default_job(train={"batch_schedule": "ramp", "ramp": {"start_batch": 3}})
    with pytest.raises(StageError, match=r"train.ramp.start_batch.*over 2 ranks"):
        batch_schedule_for(uneven, None, {**CHOSEN, "batch": 96}, ranks=2)
    with pytest.raises(StageError, match=r"field 'train.batch_schedule': adaptive.*--perfmodel"):
        batch_schedule_for(default_job(train={"batch_schedule": "adaptive"}), None, CHOSEN, ranks=2)
