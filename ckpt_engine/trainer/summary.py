"""What a job prints and returns: one line per sync, and the summary of the whole run.

Shared by every way the job runs (reference engines in one process, vLLM + FSDP2 processes, Ray
actors), so the launchers import it and not each other. Each sync reports the bytes it put on the
wire next to what a dense sync of the same plan sends, and its delta kind (`off`: no delta,
`seed`: dense, (re)seeding the engines' bases, `patch`: only the changed words travelled).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ckpt_engine.daemon.outcome import size_text, wire_text

__all__ = [
    "OVERHEAD_STAGES", "accuracy", "format_summary", "format_sync", "greedy_answers", "summarize", "sync_overhead",
]

OVERHEAD_STAGES = ("validate", "pause", "finalize", "resume", "swap")


def sync_overhead(rec: Any) -> dict[str, float]:
    """A sync's seconds beyond the transfer: the engine-control stages and the rest (plan, probes,
    group set-up, walk barrier, RPC round trips), and their share of the whole sync."""
    stages = rec.stages
    if not rec.ok or "transfer" not in stages:
        return {}
    out = {k: stages.get(k, 0.0) for k in OVERHEAD_STAGES}
    total = rec.seconds
    out["other"] = max(0.0, total - stages["transfer"] - sum(out.values()))
    out["overhead"] = max(0.0, total - stages["transfer"])
    out["fraction"] = out["overhead"] / total if total > 0 else 0.0
    return out


def _wire_dense(rec: Any) -> tuple[int, int]:
    """(wire, dense) bytes of a sync record (a plain dense sync: both are its bytes)."""
    dense = int(getattr(rec, "dense_bytes", 0)) or int(rec.bytes)
    wire = int(getattr(rec, "wire_bytes", 0)) or dense
    return wire, dense


def format_sync(rec: Any, last_step: Any) -> str:
    """One line per sync: version, wire vs dense bytes and delta kind, senders, seconds, GB/s,
    the consumed samples' staleness, and the overhead beyond the transfer."""
    ov = sync_overhead(rec)
    senders = int(getattr(rec, "senders", 1))
    line = (
        f"sync v{rec.version:<3} step {rec.step:<3} {rec.reason:<8} {wire_text(vars(rec))}  "
        f"{senders} sender{'s' if senders != 1 else ''}  {rec.seconds:6.3f} s {rec.gbps:6.3f} GB/s  "
        f"staleness max {last_step.staleness_max if last_step else 0} "
        f"mean {last_step.staleness_mean if last_step else 0.0:.2f}  reward {last_step.reward if last_step else 0.0:.2f}"
    )
    if rec.ok and "transfer" in rec.stages:  # issue 28: what the engines lost, beside what the transfer took
        line += f"  staged {rec.staged} stall {rec.stall_s * 1e3:.1f} ms / transfer {rec.stages['transfer'] * 1e3:.1f} ms"
    if ov:
        parts = " ".join(f"{k} {ov[k] * 1e3:.0f}" for k in (*OVERHEAD_STAGES, "other"))
        line += f"  overhead {ov['fraction']:.0%} ({parts} ms)"
    if rec.dropped:
        line += f"  dropped {rec.dropped}"
    return line


def greedy_answers(generators: list[Any], prompts: torch.Tensor) -> dict[str, list[int] | None]:
    """Every engine's greedy answer to each prompt (None where the engine gave none)."""
    out = {}
    for g in generators:
        ans = g.greedy(prompts)
        out[g.name] = None if ans is None else ans.tolist()
    return out


def accuracy(answers: dict[str, list[int] | None], truth: torch.Tensor) -> dict[str, float | None]:
    return {n: None if a is None else float((torch.tensor(a) == truth).float().mean()) for n, a in answers.items()}


def _wire_totals(syncs: list[Any]) -> dict[str, Any]:
    done = [s for s in syncs if s.ok]
    pairs = [_wire_dense(s) for s in done]
    return {
        "wire_bytes": sum(w for w, _ in pairs),
        "dense_bytes": sum(d for _, d in pairs),
        "delta_kinds": dict(Counter(getattr(s, "delta", "off") for s in done)),
        "senders": max((int(getattr(s, "senders", 1)) for s in done), default=1),
    }


def summarize(job: Any, summary: Any, before: dict[str, Any], after: dict[str, Any], answer: torch.Tensor) -> dict[str, Any]:
    """The job's summary as a plain (JSON-able) dict."""
    syncs = list(summary.syncs)
    overheads = [sync_overhead(s) for s in syncs]
    return {
        **{k: v for k, v in vars(summary).items() if k != "syncs"},
        "syncs": [{**vars(s), "overhead": ov} for s, ov in zip(syncs, overheads)],
        **_wire_totals(syncs),
        "delta_mode": job.checkpoint_engine.delta,
        "senders_mode": job.checkpoint_engine.senders,
        "greedy_before": before,
        "greedy_after": after,
        "outputs_changed": {n: before[n] is not None and after.get(n) is not None and before[n] != after[n] for n in before},
        "accuracy_before": accuracy(before, answer),
        "accuracy_after": accuracy(after, answer),
        "max_staleness": job.trainer.max_staleness,
    }


def format_summary(job: Any, result: dict[str, Any]) -> list[str]:
    """The summary lines: versions, staleness, rewards; wire vs dense bytes; overhead; answers."""
    versions = result["versions"]
    lines = [
        f"summary: {result['steps']} steps, versions {versions[0] if versions else '-'}..{result['final_version']} "
        f"({len(versions)} syncs), engines {result['engine_versions']}, staleness max {result['staleness_max']} "
        f"(bound {job.trainer.max_staleness}) mean {result['staleness_mean']:.2f}, dropped stale {result['samples_dropped_stale']}, "
        f"reward {result['reward_first']:.2f} -> {result['reward_last']:.2f}, "
        f"greedy accuracy {result['accuracy_before']} -> {result['accuracy_after']}"
    ]
    wire, dense = result.get("wire_bytes", 0), result.get("dense_bytes", 0)
    kinds = result.get("delta_kinds") or {}
    per_sync = [f"v{s['version']} {wire_text(s)}" for s in result["syncs"] if s["ok"]]
    lines.append(
        f"  wire {size_text(wire)} of {size_text(dense)} dense ({100.0 * wire / dense if dense else 100.0:.1f} %) "
        f"over {len(per_sync)} syncs; delta={result.get('delta_mode', 'off')}: "
        + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        + f"; senders={result.get('senders_mode', 'auto')}: {result.get('senders', 1)} per sync"
    )
    if any(s.get("delta", "off") != "off" for s in result["syncs"] if s["ok"]):  # else every sync line said "dense"
        lines.append("  per sync: " + "; ".join(per_sync))
    # Overhead over the steady-state syncs (the first builds the group and is reported on its line).
    steady = [s["overhead"] for s in result["syncs"][1:] if s["overhead"]]
    if steady:
        secs = [s["seconds"] for s in result["syncs"][1:] if s["overhead"]]
        ov = sum(o["overhead"] for o in steady)
        lines.append(
            f"  per-sync overhead beyond the transfer (syncs 2..): mean {ov / len(steady) * 1e3:.0f} ms of "
            f"{sum(secs) / len(secs) * 1e3:.0f} ms = {ov / sum(secs):.0%}; "
            + ", ".join(f"{k} {sum(o[k] for o in steady) / len(steady) * 1e3:.1f} ms" for k in (*OVERHEAD_STAGES, "other"))
        )
    for name in result["greedy_before"]:
        changed = "changed" if result["outputs_changed"][name] else "UNCHANGED"
        lines.append(f"  {name}: greedy answers before {result['greedy_before'][name]}")
        lines.append(f"  {' ' * len(name)}  greedy answers after  {result['greedy_after'].get(name)}  ({changed})")
    return lines
