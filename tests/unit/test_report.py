"""The report stage reads the files it is given and writes exactly the files it is told to (the rule declares them)."""

import json

from tests.conftest import REPO
from tests.unit.report_inputs import CANDIDATES, INPUTS, PLOTS
from tula_hpc.stages.report import main


def test_report_writes_exactly_its_declared_outputs_and_links_each_plot(tmp_path):
    given, out_dir = tmp_path / "given", tmp_path / "out"
    given.mkdir()
    args = ["--config", str(REPO / "config" / "jobs.yaml"), "--job", "digits-cnn"]
    for name, content in INPUTS.items():
        (given / f"{name}.json").write_text(json.dumps(content))
        args += [f"--{name}", str(given / f"{name}.json")]
    outputs = {"--out": "report.md", **PLOTS}
    for flag, name in outputs.items():
        args += [flag, str(out_dir / name)]

    assert main(args) == 0

    written = {str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()}
    assert written == set(outputs.values())  # no temporary or undeclared file left behind
    for name in PLOTS.values():
        assert (out_dir / name).read_bytes()[:4] == b"\x89PNG"
    report = (out_dir / "report.md").read_text()
    assert "**2 node(s), global batch 128**" in report
    for name in PLOTS.values():
        assert f"]({name})" in report
    # A preemption saved mid-epoch; running out of memory relaunched at the same global batch.
    assert "resumed from its checkpoint at step 13 (epoch 2, step 3)" in report
    assert "known here at most 0.4 s after the rank recorded it" in report
    assert "64 per device as 2 x 32: completed" in report
    # Which sync terms the profiles fitted and which are the job's priors.
    assert "intra-node 10.0 us per hop (fitted) + 0.100 s/GB moved (fitted)" in report
    assert "inter-node 14.0 us per hop (prior) + 0.080 s/GB moved (prior)" in report
    assert "overlap g = 2.00 (exposed share of sync at N = 2: 80% at b = 32, 25% at b = 256)" in report
    # The allocated bytes size the batch: 20 MB + 30 kB x 512 allocated, 21 MB + 31 kB x 512 reserved in the probes.
    assert "35.4 MB allocated at batch 512, for which the caching allocator reserved 36.9 MB" in report
    # CUDA's trials bracketed the card's limit: both largest batches and the allowance are shown.
    assert "the largest batch that ran is 530, 535 ran out of memory" in report
    assert "needed no allocator retry is 512" in report and "could not give back 320.0 MB" in report
    # The fixed memory by what holds it: cuBLAS's workspace is not optimiser state, autocast's weight copies are
    # not activations.
    assert (
        "of which fixed parameters and buffers 1.00 MB, optimiser state 1.00 MB, workspace kept (cuBLAS, cuDNN) "
        "4.00 MB, autocast's weight copies 0.50 MB, DDP buckets 1.00 MB, NCCL ring buffers (estimated) 0.00 MB, "
        "gradients and temporaries 13.50 MB;\nper sample batch 0.30 kB" in report
    )
    # Training's loading and device memory held against what the profiles and the memory model said.
    assert "training waited 0.90 s for its loader (10.0% of the steps' time)" in report
    assert "load for 20.0% of a step at this configuration" in report
    assert "Training's peak device memory 21.20 MB allocated (22.50 MB reserved) against 20.96 MB" in report
    assert "at 32 samples per device at once" in report
    assert "(CUDA context, NCCL's communicators) 1234.0 MB in training, against 1100.0 MB" in report
    assert "| 32 | measured | 20960000 | 21992000 | 960000 | 500000 | 1000000 | 1000000 | 4000000 |" in report


def test_the_report_shows_the_chosen_node_shape_and_tells_shapes_with_the_same_nodes_apart(tmp_path):
    """Two GPUs per node beside one at the same N: each its own row, curve and cost cell."""
    shaped = [{**c, "gpus_per_node": 1} for c in CANDIDATES]
    shaped += [{**c, "gpus_per_node": 2, "per_device_batch": c["per_device_batch"] // 2} for c in CANDIDATES]
    chosen = shaped[-2]  # 2 nodes x 2 GPUs, batch 128
    inputs = {
        **INPUTS,
        "perfmodel": {**INPUTS["perfmodel"], "candidates": shaped},
        "selection": {**INPUTS["selection"], "chosen": chosen, "runners_up": shaped[:1]},
    }
    report = _render(tmp_path, inputs)
    assert "**2 node(s) x 2 GPU(s), global batch 128** (32 per device)" in report
    assert "| runner-up N | GPUs/node | B |" in report and "| 1 | 1 | 64 |" in report
    assert "| 2 | 2 | 128 | 32 |" in report and "| 2 | 1 | 128 | 64 |" in report  # every candidate, shapes apart


def _render(tmp_path, inputs: dict) -> str:
    args = ["--config", str(REPO / "config" / "jobs.yaml"), "--job", "digits-cnn"]
    for name, content in inputs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
        args += [f"--{name}", str(tmp_path / f"{name}.json")]
    for flag, name in {"--out": "report.md", **PLOTS}.items():
        args += [flag, str(tmp_path / name)]
    assert main(args) == 0
    return (tmp_path / "report.md").read_text()


def test_an_image_eval_json_naming_its_task_gives_the_report_an_old_eval_json_gave(tmp_path):
    from tula_hpc.training.evaluation import scored
    from tula_hpc.training.tasks import ImageClassification

    named = {**INPUTS["eval"], **scored(ImageClassification(), {"accuracy": 0.9, "loss": 0.3}, {"accuracy": 0.9})}
    (tmp_path / "old").mkdir(), (tmp_path / "new").mkdir()
    assert _render(tmp_path / "old", INPUTS) == _render(tmp_path / "new", {**INPUTS, "eval": named})


def test_a_causal_lm_report_speaks_of_loss_per_character_perplexity_bits_and_tokens_per_second(tmp_path):
    from tula_hpc.training.evaluation import scored
    from tula_hpc.training.tasks import CausalLM

    values = {"loss": 1.5, "perplexity": 4.4817, "bits": 2.164, "token_accuracy": 0.5}
    evaluation = {**INPUTS["eval"], **scored(CausalLM(token_unit="character"), values, {"loss": 1.6})}
    profiled = [{**p, "samples_per_s": 100.0, "tokens_per_s": 6400.0} for p in INPUTS["perfmodel"]["profiled"]]
    history = [
        {k: v for k, v in r.items() if k != "val_accuracy"} | {"val_loss": 2.0 / r["epoch"]}
        for r in INPUTS["summary"]["history"]
    ]
    mid = {"kind": "validation", "step": 5, "epoch": 0, "val_loss": 2.5}
    history = [mid, *[{**r, "step": 10 * r["epoch"]} for r in history]]
    inputs = {
        **INPUTS,
        "eval": evaluation,
        "perfmodel": {**INPUTS["perfmodel"], "profiled": profiled, "seq_len": 64},
        "summary": {**INPUTS["summary"], "history": history},
    }
    report = _render(tmp_path, inputs)
    assert "Test loss **1.5 nats per character**\non 360 windows" in report
    assert "as trained\n1.6 nats per character); perplexity 4.482 per character" in report
    assert "bits per character 2.164 bits; next-token accuracy 50.00%." in report
    assert "top-1" not in report and "images" not in report
    assert "| samples/s | tokens/s |" in report and "| 100.0 | 6400 |" in report
