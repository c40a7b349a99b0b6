"""Predicted vs measured (our GPU bench files) and vs published figures, as markdown.

``ckpt-engine plan --validate`` writes ``bench/plan/validation.md`` from this module, so the
table in the README and bench/RESULTS.md is produced by a command, never typed. Its last table
says what the pull transport (`backend: nixl`) would give on the published 235B and Kimi-K2
set-ups: modelled, with nothing measured to hold it against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ckpt_engine.plan.bench_rows import load_rows
from ckpt_engine.plan.cost import predict
from ckpt_engine.plan.params import Calibration
from ckpt_engine.plan.peer_join import JoinPrediction, predict_join
from ckpt_engine.plan.published import load_published

__all__ = ["PULL_MODELS", "PullRow", "ValidationRow", "measured_rows", "published_rows", "pull_rows", "to_markdown"]

GOAL = 0.15
PULL_MODELS = ("qwen3-235b-a22b", "kimi-k2")
"""The published rows the pull table covers (issue 43: "the planner's 235B / Kimi-K2 rows")."""


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


@dataclass(frozen=True)
class PullRow:
    """One published set-up: its broadcast as modelled, the same sync by pull, the pull with receive
    plans from every shard, and a late joiner's time to serve from a peer."""

    label: str
    broadcast_s: float
    pull_s: float
    pull_bottleneck: str
    pull_shard_s: float
    pull_shard_bottleneck: str
    join: JoinPrediction


def pull_rows(cal: Calibration) -> list[PullRow]:
    out = []
    for fig in load_published():
        if fig.scenario.model not in PULL_MODELS:
            continue
        sc = fig.scenario
        pull = predict(replace(sc, backend="nixl").setup(), cal)
        shard = predict(replace(sc, backend="nixl", receive="shard", strategy="all-senders").setup(), cal)
        setup = sc.setup()
        join = predict_join(setup.model, setup.rollout, setup.links, cal)
        out.append(PullRow(fig.name, predict(setup, cal).total_s, pull.total_s, pull.bottleneck, shard.total_s, shard.bottleneck, join))
    return out


def _pull_markdown(rows: list[PullRow]) -> list[str]:
    lines = ["", "### The pull transport on the same set-ups (backend: nixl; modelled)", ""]
    lines += ["| set-up | broadcast, predicted s | sync by pull, same settings s | pull, all senders + receive plans s | "
              "late joiner serves in s | of it: reads, checksums (joiner + peer), fixed | without the checksums s | bar: bytes/link + 2 s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        j = r.join
        lines.append(
            f"| {r.label} | {_fmt(r.broadcast_s)} | {_fmt(r.pull_s)} ({r.pull_bottleneck}) | {_fmt(r.pull_shard_s)} ({r.pull_shard_bottleneck}) | "
            f"{_fmt(j.total_s)} | {j.bytes_per_rank / 1e9:.1f} GB per rank over {j.link} at {j.link_gbs:.0f} GB/s: {_fmt(j.read_s)}, "
            f"{_fmt(j.check_s)} + {_fmt(j.peer_check_s)}, {_fmt(j.fixed_s + j.window_s)} | {_fmt(j.without_checksums_s)} | {_fmt(j.bar_s)} |"
        )
    return lines


def _fmt(s: float) -> str:
    return f"{s:.4f}" if s < 1 else f"{s:.2f}"


def to_markdown(measured: list[ValidationRow], published: list[ValidationRow], command: str, pulls: list[PullRow] | None = None) -> str:
    """Two tables and a summary line each, then the pull transport's table when given."""
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
    if pulls:
        lines += _pull_markdown(pulls)
    return "\n".join(lines) + "\n"
