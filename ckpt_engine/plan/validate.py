"""Predicted vs measured (our GPU bench files) and vs published figures, as markdown.

``ckpt-engine plan --validate`` writes ``bench/plan/validation.md`` from this module, so the
table in the README and bench/RESULTS.md is produced by a command, never typed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_engine.plan.bench_rows import load_rows
from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.published import load_published

__all__ = ["ValidationRow", "measured_rows", "published_rows", "to_markdown"]

GOAL = 0.15


@dataclass(frozen=True)
class ValidationRow:
    """One comparison: what, where from, measured/published and predicted seconds."""

    label: str
    source: str
    kind: str
    reference_s: float
    predicted_s: float
    role: str
    note: str = ""

    @property
    def error(self) -> float:
        return self.predicted_s / self.reference_s - 1


def measured_rows(paths: list[str], cal: Calibration) -> list[ValidationRow]:
    """Every GPU row in the bench files; ``role`` says whether its file was fitted on."""
    fitted = set(cal.sources)
    return [
        ValidationRow(r.label, r.source, r.kind, r.measured_s, r.predict_s(cal), "fit" if r.source in fitted else "held out", r.note)
        for r in load_rows(paths)
    ]


def published_rows(cal: Calibration) -> list[ValidationRow]:
    out = []
    for fig in load_published():
        p = predict(fig.scenario.setup(), cal)
        note = f"bottleneck {p.bottleneck}; {fig.assumptions}"
        out.append(ValidationRow(fig.name, fig.source, "published", fig.published_s, p.total_s, "fit" if fig.fit else "predicted", note))
    return out


def _fmt(s: float) -> str:
    return f"{s:.4f}" if s < 1 else f"{s:.2f}"


def to_markdown(measured: list[ValidationRow], published: list[ValidationRow], command: str) -> str:
    """Two tables and a summary line each."""
    lines = [f"<!-- written by `{command}`; do not edit by hand -->", "", "### Predicted vs measured (bench/results/: 2xH200 GPU runs; CPU-box runs over emulated links)", ""]
    lines += ["| measurement | kind | file | measured s | predicted s | error | within 15 % | role | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in measured:
        ok = "yes" if abs(r.error) <= GOAL else "**no**"
        lines.append(f"| {r.label} | {r.kind} | `{r.source}` | {_fmt(r.reference_s)} | {_fmt(r.predicted_s)} | {r.error:+.1%} | {ok} | {r.role} | {r.note} |")
    inside = sum(abs(r.error) <= GOAL for r in measured)
    held = [r for r in measured if r.role == "held out"]
    lines += ["", f"{inside} of {len(measured)} rows within 15 % (largest error {max((abs(r.error) for r in measured), default=0):.1%}); "
              f"held-out rows: {sum(abs(r.error) <= GOAL for r in held)} of {len(held)} within 15 %.", ""]
    lines += ["### Predicted vs published (other systems, modelled as published)", ""]
    lines += ["| set-up | source | published s | predicted s | error | role | bottleneck and assumptions |", "|---|---|---|---|---|---|---|"]
    for r in published:
        lines.append(f"| {r.label} | {r.source} | {_fmt(r.reference_s)} | {_fmt(r.predicted_s)} | {r.error:+.0%} | {r.role} | {r.note} |")
    return "\n".join(lines) + "\n"
