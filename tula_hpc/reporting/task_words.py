"""The task's words in the report, from eval.json (training/evaluation.scored): the headline metric, its label and
unit, the other metrics printed beside it and what a sample is called, so that no section branches on a task's name.
An eval.json written before tasks existed names none of them: it reads as image classification's top-1 accuracy."""

from __future__ import annotations

from dataclasses import dataclass

IMAGE_WORDS = {
    "headline": "accuracy",
    "metrics": {"accuracy": {"label": "top-1 accuracy", "unit": "", "higher_is_better": True}},
    "sample_noun": "image",
    "beside_headline": [],
}


@dataclass(frozen=True)
class TaskWords:
    headline: str
    metrics: dict[str, dict]  # name: {label, unit, higher_is_better}
    sample_noun: str
    beside_headline: list[str]

    @classmethod
    def of(cls, evaluation: dict) -> TaskWords:
        return cls(**{key: evaluation.get(key, default) for key, default in IMAGE_WORDS.items()})

    def label(self, name: str) -> str:
        return self.metrics[name]["label"]

    def is_share(self, name: str) -> bool:
        """A metric without a unit is a share (tasks.Metric), printed as a percentage."""
        return not self.metrics[name]["unit"]

    def value(self, name: str, value: float) -> str:
        """`value` of metric `name` as the report prints it: a share in percent, else with its unit."""
        return f"{value:.2%}" if self.is_share(name) else f"{value:.4g} {self.metrics[name]['unit']}"

    def test_scores(self, evaluation: dict) -> str:
        """The test scores printed after the headline's, each with its label ("" when there are none)."""
        return "".join(
            f"; {self.label(name)} {self.value(name, evaluation[f'test_{name}'])}"
            for name in self.beside_headline
            if f"test_{name}" in evaluation
        )
