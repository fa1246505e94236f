"""Stage `fit_model`: the parallel performance model of paper Eq. 2 and 4, fitted to the profiles.

t_step(N, b) = local(b) + (1 - overlap) * sync(N), where
  local(b) = a0 + a1 * b                              data + forward/backward + update, linear in b (Eq. 2b)
  sync(N)  = 2(N-1) * latency + 2(N-1)/N * bytes / bw  ring all-reduce (Eq. 2c), zero on one rank
and overlap is the share of sync hidden behind backward in real DDP steps. Coefficients are
non-negative. Then T = E * steps_per_epoch(B) * t_step (Eq. 4a) and C = T * N * price (Eq. 4b).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import LinearRegression

from .files import read_json, write_json
from .stage import stage_main

HOUR_S = 3600.0


def ring_features(ranks: np.ndarray, grad_bytes: float) -> np.ndarray:
    """Columns: latency hops 2(N-1) and bytes moved per rank 2(N-1)/N * gradient bytes."""
    ranks = np.asarray(ranks, float)
    return np.column_stack([2 * (ranks - 1), 2 * (ranks - 1) / ranks * grad_bytes])


class PerfModel(BaseEstimator, RegressorMixin):
    """Step time from X = [[ranks, per_device_batch], ...]; fit with the measured parts of each step."""

    def __init__(self, grad_bytes: float = 0.0):
        self.grad_bytes = grad_bytes

    def fit(self, X, y, *, local_s=None, sync_s=None) -> "PerfModel":
        X = np.asarray(X, float)
        y = np.asarray(y, float)
        ranks, batch = X[:, 0], X[:, 1]
        local_s = y if local_s is None else np.asarray(local_s, float)
        sync_s = np.zeros_like(y) if sync_s is None else np.asarray(sync_s, float)
        local = LinearRegression(positive=True).fit(batch.reshape(-1, 1), local_s)
        self.local_intercept_s_ = max(0.0, float(local.intercept_))
        self.local_per_sample_s_ = float(local.coef_[0])
        multi = ranks > 1
        if multi.any():
            sync = LinearRegression(positive=True, fit_intercept=False).fit(ring_features(ranks[multi], self.grad_bytes), sync_s[multi])
            self.latency_s_, self.seconds_per_byte_ = (float(c) for c in sync.coef_)
            hidden = (self._local(batch[multi]) + self._sync(ranks[multi]) - y[multi]) / np.maximum(self._sync(ranks[multi]), 1e-12)
            self.overlap_ = float(np.clip(np.median(hidden), 0.0, 1.0))
        else:
            self.latency_s_ = self.seconds_per_byte_ = self.overlap_ = 0.0
        residual = (self.predict(X) - y) / y
        self.rel_uncertainty_ = float(np.sqrt(np.mean(residual ** 2)))
        return self

    def _local(self, batch) -> np.ndarray:
        return self.local_intercept_s_ + self.local_per_sample_s_ * np.asarray(batch, float)

    def _sync(self, ranks) -> np.ndarray:
        return ring_features(ranks, self.grad_bytes) @ np.array([self.latency_s_, self.seconds_per_byte_])

    def predict(self, X) -> np.ndarray:
        X = np.asarray(X, float)
        return self._local(X[:, 1]) + (1 - self.overlap_) * self._sync(X[:, 0])

    def params(self) -> dict:
        return {k: getattr(self, k) for k in ("local_intercept_s_", "local_per_sample_s_", "latency_s_",
                                              "seconds_per_byte_", "overlap_", "rel_uncertainty_")}


def steps_per_epoch(train_samples: int, ranks: int, per_device_batch: int) -> int:
    """As DistributedSampler + DataLoader(drop_last=False) do it: each rank's share, in batches."""
    return math.ceil(math.ceil(train_samples / ranks) / per_device_batch)


def predict_candidates(model: PerfModel, candidates: list[dict], devices_per_node: int, train_samples: int,
                       epochs: int, price_per_node_hour: float) -> list[dict]:
    rows = []
    for c in candidates:
        ranks = c["nodes"] * devices_per_node
        step = float(model.predict([[ranks, c["per_device_batch"]]])[0])
        per_epoch = steps_per_epoch(train_samples, ranks, c["per_device_batch"])
        total = epochs * per_epoch * step
        rows.append({**c, "step_s": step, "steps_per_epoch": per_epoch, "epoch_s": per_epoch * step, "time_s": total,
                     "cost": total / HOUR_S * c["nodes"] * price_per_node_hour,
                     "time_s_range": [total * (1 - model.rel_uncertainty_), total * (1 + model.rel_uncertainty_)]})
    return rows


def fit_model(job: dict, plan_path: Path, profile_paths: list[Path], out: Path) -> dict:
    plan = read_json(plan_path)
    profiles = [read_json(p) for p in profile_paths]
    devices = max(1, job["resources"]["gpus_per_node"])
    X = [[p["world_size"], p["per_device_batch"]] for p in profiles]
    med = [p["median"] for p in profiles]
    model = PerfModel(grad_bytes=profiles[0]["grad_bytes"]).fit(
        X, [m["step_s"] for m in med],
        local_s=[m["data_s"] + m["compute_s"] + m["update_s"] for m in med], sync_s=[m["sync_s"] for m in med])
    measured = [{"nodes": p["nodes"], "batch": p["global_batch"], "per_device_batch": p["per_device_batch"],
                 "measured_step_s": p["median"]["step_s"], "predicted_step_s": float(model.predict([x])[0])}
                for p, x in zip(profiles, X)]
    result = {
        "job": job["name"], "model": "ring-allreduce", "params": model.params(), "grad_bytes": model.grad_bytes,
        "train_samples": plan["dataset"]["train"], "epochs": job["train"]["epochs"],
        "price_per_node_hour": job["objective"]["price_per_node_hour"], "profiled": measured,
        "candidates": predict_candidates(model, plan["candidates"], devices, plan["dataset"]["train"],
                                         job["train"]["epochs"], job["objective"]["price_per_node_hour"]),
    }
    write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    def add_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--plan", required=True, type=Path)
        parser.add_argument("--profiles", required=True, type=Path, nargs="+", help="profile/N{n}_B{b}.json files")
        parser.add_argument("--out", required=True, type=Path, help="results/{job}/perfmodel.json")

    return stage_main("fit-model", add_args, lambda job, args: fit_model(job, args.plan, args.profiles, args.out), argv)


if __name__ == "__main__":
    raise SystemExit(main())
