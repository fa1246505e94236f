"""The built-in GPT: logits of the right shape, a causal mask, tied embeddings, GPT-2's initialisation, and a build
on the meta device as validation does it."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from tula_hpc.training.gpt import INIT_STD, gpt
from tula_hpc.training.models import BUILTINS

VOCAB, T = 11, 16


def small(**kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt(VOCAB, T, **{"layers": 2, "heads": 2, "width": 16, **kwargs}).eval()


def test_logits_have_a_row_per_token_and_a_column_per_vocabulary_entry():
    ids = torch.randint(0, VOCAB, (3, T))
    assert small()(ids).shape == (3, T, VOCAB)
    assert small()(ids[:, :5]).shape == (3, 5, VOCAB)


def test_a_changed_token_leaves_the_logits_before_it_unchanged():
    model, ids = small(), torch.randint(0, VOCAB, (2, T))
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 1) % VOCAB
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_padding_is_hidden_from_the_tokens_that_follow_it():
    model, ids = small(), torch.randint(0, VOCAB, (1, T))
    mask = torch.ones(1, T, dtype=torch.long)
    mask[0, 3] = 0
    changed = ids.clone()
    changed[0, 3] = (ids[0, 3] + 1) % VOCAB
    torch.testing.assert_close(model(ids, mask)[:, 4:], model(changed, mask)[:, 4:])
    assert torch.isfinite(model(ids, mask)).all()


def test_the_output_layer_is_the_token_embedding():
    model = small()
    assert model.head.weight is model.tokens.weight
    assert sum(p is model.tokens.weight for p in model.parameters()) == 1


def test_gpt2_initialisation_scales_the_residual_projections_by_depth():
    model = small(layers=4, width=64)
    residual = INIT_STD / math.sqrt(2 * 4)
    for block in model.blocks:
        assert block.attention.proj.weight.std().item() == pytest.approx(residual, rel=0.2)
        assert block.mlp[2].weight.std().item() == pytest.approx(residual, rel=0.2)
        assert block.attention.qkv.weight.std().item() == pytest.approx(INIT_STD, rel=0.2)
        assert not block.attention.qkv.bias.any()


def test_a_sequence_longer_than_the_context_is_refused():
    with pytest.raises(ValueError, match="longer than the model's context of 16"):
        small()(torch.zeros(1, T + 1, dtype=torch.long))


def test_width_must_split_into_heads():
    with pytest.raises(ValueError, match="multiple of heads"):
        gpt(VOCAB, T, heads=3, width=16)


def test_the_builtin_is_registered_and_runs_on_the_meta_device():
    """Validation builds models on the meta device (shapes only); build_model passes vocab_size and seq_len once the
    data's shape carries them."""
    module, _, name = BUILTINS["gpt"].partition(":")
    assert getattr(importlib.import_module(module), name) is gpt
    with torch.device("meta"):
        model = gpt(50257, 1024, layers=12, heads=12, width=768)
        logits = model(torch.zeros(2, 1024, dtype=torch.long))
    assert logits.shape == (2, 1024, 50257) and logits.device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small's
