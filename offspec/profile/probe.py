"""Probes: the draft model's acceptance measured again where `budget="auto"` stopped running it.

A hybrid policy (offspec/profile/adapt.py) runs the draft model only where its acceptance estimate says the
model's tree pays: each pass weighs it against the suffix candidates (`choosing`), and a plan that predicts no
tree beats the target alone runs gated suffix passes only. The estimate moves only with passes that ran the model,
so one pessimistic window (24 passes of prose that accepted less than the stretch around them) could turn the
model off for good: measured on MT-Bench with the default pair, the scale fell from 1.0 to 0.69 after the second
question and no model pass ran for the next four, though a model chain of one node took 0.72 tokens a pass there
and beat the target alone by 1.15x.

So where the model has not run for `every` passes, and those passes yielded fewer tokens a pass than the model
would at the profile's acceptance, the next `passes` passes run the model's tree anyway (a probe). What they
accept is the measurement: the policy takes its scale from them alone (`AdaptiveBudget._end_probe`). A probe that
leaves the estimate where it was, or lowers it, doubles `every` (up to `max_every`); one that raises it resets
`every`. Where suffix candidates yield as much as the model would (a long copy), no probe runs.

This module keeps the probe's state; the policy decides what a probe pass proposes and what the measurement
changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeConfig:
    every: int = 32  # passes without the draft model before a probe (while they yield less than it would)
    passes: int = 8  # passes in one probe
    min_model_passes: int = 4  # passes of a probe that must run the model for it to conclude
    max_every: int = 512  # `every` doubles while probes do not raise the estimate, up to this


class ModelProbe:
    """`idle()` / `ran_model()` after each pass that did not / did run the model; `start_if_due()` before a pass;
    `record()` for each probe pass, then `finish()` when `left` reaches 0."""

    def __init__(self, config: ProbeConfig = ProbeConfig()):
        self.config = config
        self.every = config.every
        self.idle_passes = 0  # passes since the draft model last ran
        self.idle_tokens = 0  # tokens those passes emitted
        self.left = 0  # passes left in the probe that is running (0: none)
        self.measured: list[tuple[int, float]] = []  # (accepted, predicted at scale 1) of its model passes
        self.runs: list[dict] = []  # what each finished probe measured and did (kept for the summary)

    @property
    def active(self) -> bool:
        return self.left > 0

    def idle(self, emitted: int) -> None:
        """A pass that did not run the draft model (gated suffix candidates, or no tree at all)."""
        self.idle_passes += 1
        self.idle_tokens += emitted

    def ran_model(self) -> None:
        self.idle_passes = self.idle_tokens = 0

    def start_if_due(self, model_tokens_per_pass: float) -> bool:
        """Whether the next pass is a probe pass: one is running, or the model has been idle for `every` passes
        that yielded fewer tokens a pass than `model_tokens_per_pass` (the model's at the profile's acceptance)."""
        if self.active:
            return True
        if self.idle_passes < self.every or self.idle_tokens >= model_tokens_per_pass * self.idle_passes:
            return False
        self.left, self.measured = self.config.passes, []
        return True

    def record(self, accepted: int, predicted: float, ran_model: bool) -> None:
        """One probe pass: its accepted count and the curve's prediction for it, where it ran the model (a confident
        copy takes the suffix candidates alone, which says nothing about the model)."""
        self.left -= 1
        if ran_model:
            self.measured.append((accepted, predicted))

    def ratio(self) -> tuple[float, float, int]:
        """(observed, predicted, model passes) over the probe's model passes: mean accepted and the curve's mean."""
        n = len(self.measured)
        if n == 0:
            return 0.0, 0.0, 0
        return sum(a for a, _ in self.measured) / n, sum(p for _, p in self.measured) / n, n

    def conclusive(self) -> bool:
        observed, predicted, n = self.ratio()
        return n >= self.config.min_model_passes and predicted > 0

    def finish(self, at_pass: int, scale_before: float, scale_after: float) -> None:
        """The probe is over: `every` resets where it raised the estimate and doubles where not (an inconclusive
        probe, whose passes were mostly confident copies, leaves it)."""
        observed, predicted, n = self.ratio()
        if self.conclusive():
            raised = scale_after > scale_before
            self.every = self.config.every if raised else min(self.config.max_every, 2 * self.every)
        self.runs.append({"at_pass": at_pass, "model_passes": n, "observed": round(observed, 4),
                          "predicted": round(predicted, 4), "scale_before": round(scale_before, 4),
                          "scale_after": round(scale_after, 4), "next_after": self.every})
        self.left, self.measured = 0, []
        self.ran_model()  # the idle count restarts after a probe, whatever it measured

    def summary(self) -> dict:
        return {"every": self.every, "idle_passes": self.idle_passes, "active": self.active,
                "runs": len(self.runs), "last": self.runs[-3:]}
