"""Training tasks as users write them, good and bad, named in configs as `tests.unit.user_tasks:NAME`."""

from __future__ import annotations

import torch.nn.functional as F

from tula_hpc.training.tasks import CausalLM, logits_of


class LossWithoutCount(CausalLM):
    """A language-model task whose loss forgets to say how many tokens it averaged."""

    def loss(self, output, batch):
        logits = logits_of(output)
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())


def loss_without_count():
    return LossWithoutCount()


def weighted_tokens(token_unit: str = "word"):
    """A good one: causal_lm's with its own token unit (task.kwargs)."""
    return CausalLM(token_unit=token_unit)


def not_a_task():
    return {"loss": "mean"}
