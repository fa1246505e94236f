"""The n-gram baselines: known answers on tiny streams."""

import math

import numpy as np
import pytest
from tula_bench import ngram_baselines as ngram


def test_a_uniform_unigram_scores_log_vocab_and_a_deterministic_text_favours_trigrams():
    cycle = np.tile(np.arange(4, dtype=np.uint8), 200)
    probabilities = ngram.order_probabilities(ngram.ngram_counts(cycle, 4), cycle[:50], k=1.0)
    assert ngram.nats(probabilities[:1], [1.0]) == pytest.approx(math.log(4))
    assert probabilities[2] == pytest.approx(np.ones(48))  # each character follows its two predecessors
    result = ngram.baselines({"train": cycle, "val": cycle[:40], "test": cycle[:60]}, 4)
    assert result["trigram_nats"] < 0.1 < result["unigram_nats"] == pytest.approx(math.log(4))
    assert sum(result["trigram_weights"].values()) == pytest.approx(1)


def test_an_unseen_context_falls_back_on_the_unigram():
    counts = ngram.ngram_counts(np.array([0, 1, 0, 1, 0], dtype=np.uint8), 3)
    probabilities = ngram.order_probabilities(counts, np.array([2, 2, 2], dtype=np.uint8), k=1.0)
    assert probabilities[1:, 0].tolist() == [0.0, 0.0] and probabilities[0, 0] == pytest.approx(1 / 8)
    assert all(w[0] > 0 for w in ngram.weight_grid())
