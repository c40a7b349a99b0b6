"""`ckpt-engine serve` (a standalone daemon) and `ckpt-engine status` (what a daemon knows).

    ckpt-engine serve --config job.yaml daemon.heartbeat_timeout_s=10 checkpoint_engine.backend=gloo
    ckpt-engine status --address 127.0.0.1:40123 --token <job token>

`serve` prints one line `CKPT_ENGINE_DAEMON address=<host:port> token=<token>` once it accepts
requests (launchers parse it), then serves until SIGINT/SIGTERM or a `shutdown` request. The
token comes from `--token`, else `$CKPT_ENGINE_TOKEN`, else a fresh random one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ckpt_engine.cli_args import OneLineParser, port_number, seconds

__all__ = ["READY_PREFIX", "serve_main", "status_main"]

READY_PREFIX = "CKPT_ENGINE_DAEMON "

logger = logging.getLogger(__name__)


def serve_main(argv: list[str] | None = None) -> int:
    from ckpt_engine.config import CheckpointEngineConfig, ConfigError, apply_overrides, check_sections, config_from_mapping, load_mapping
    from ckpt_engine.daemon.config import DaemonConfig
    from ckpt_engine.daemon.coordinator import WeightSyncDaemon

    p = OneLineParser(prog="ckpt-engine serve", description="run the weight-sync daemon (membership, versions, status)")
    p.add_argument("--config", help="job YAML (sections checkpoint_engine, daemon, ...)")
    p.add_argument("--host", help="bind address (overrides daemon.host)")
    p.add_argument("--port", type=port_number, help="control port in [0, 65535], 0 = free port from the OS (overrides daemon.port)")
    p.add_argument("--token", help="per-job token every request must carry (default: $CKPT_ENGINE_TOKEN or random)")
    p.add_argument("--token-file", help="also write the token to this file (mode 0600)")
    p.add_argument("--log-level", default=os.environ.get("CKPT_ENGINE_LOG", "INFO"))
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. daemon.heartbeat_timeout_s=10")
    args = p.parse_args(argv)
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        p.error(f"--log-level: {args.log_level!r} is not a level; one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        data = apply_overrides(load_mapping(args.config), args.overrides)
        check_sections(data, ("checkpoint_engine", "daemon"))
        ce = config_from_mapping(CheckpointEngineConfig, data, "checkpoint_engine")
        dc = config_from_mapping(DaemonConfig, data, "daemon")
    except ConfigError as exc:
        print(f"ckpt-engine serve: {exc}", file=sys.stderr)
        return 2
    token = args.token if args.token is not None else os.environ.get("CKPT_ENGINE_TOKEN") or None
    try:
        daemon = WeightSyncDaemon(ce, dc, token=token, role="standalone")
    except ValueError as exc:
        print(f"ckpt-engine serve: {'--token: ' if 'token' in str(exc) else ''}{exc}", file=sys.stderr)
        return 2
    if args.token_file:  # written before the daemon listens: a path it cannot write is refused first
        try:
            path = Path(args.token_file)
            path.touch(mode=0o600)
            path.write_text(daemon.token)
        except OSError as exc:
            daemon.close()
            print(f"ckpt-engine serve: --token-file: {exc}", file=sys.stderr)
            return 2
    try:
        server = daemon.serve(args.host, args.port)
    except ValueError as exc:  # the address is taken or cannot be bound
        print(f"ckpt-engine serve: --host/--port (daemon.host/daemon.port): {exc}; pick another port, or 0 for a free one", file=sys.stderr)
        return 2
    daemon.start_monitor()
    print(f"{READY_PREFIX}address={daemon.address} token={daemon.token}", flush=True)

    def stop(signum: int, frame: Any) -> None:
        server.close()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not server.stopped.wait(0.5):
            pass
    finally:
        daemon.close()
    logger.info("daemon stopped")
    return 0


def status_main(argv: list[str] | None = None) -> int:
    from ckpt_engine.daemon.client import DaemonClient
    from ckpt_engine.control.wire import RpcError, WireError

    p = OneLineParser(prog="ckpt-engine status", description="show a daemon's engines, versions, last sync and health")
    p.add_argument("--address", required=True, help="host:port the daemon printed")
    p.add_argument("--token", default=os.environ.get("CKPT_ENGINE_TOKEN"), help="the job token (default: $CKPT_ENGINE_TOKEN)")
    p.add_argument("--timeout-s", type=seconds, default=10.0, help="bound on the request, in (0, 604800] seconds")
    p.add_argument("--json", action="store_true", help="print the raw status map as JSON")
    args = p.parse_args(argv)
    if not args.token:
        print("ckpt-engine status: give --token or set CKPT_ENGINE_TOKEN", file=sys.stderr)
        return 2
    try:
        client = DaemonClient(args.address, args.token, timeout_s=args.timeout_s)
    except ValueError as exc:
        print(f"ckpt-engine status: --address: {exc}", file=sys.stderr)
        return 2
    try:
        status = client.status()
        client.close()
    except (ValueError, WireError, RpcError) as exc:
        print(f"ckpt-engine status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2, default=_json_default))
    else:
        render_status(status)
    return 0


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    return str(obj)


def render_status(status: dict[str, Any]) -> None:
    """Rich tables: daemon, engines, departed engines, last sync, recent syncs."""
    from rich.console import Console
    from rich.table import Table

    from ckpt_engine.daemon.outcome import wire_text

    console = Console(width=max(120, Console().width))
    head = Table(title="ckpt-engine daemon", show_header=False)
    head.add_row("address", str(status.get("address")))
    head.add_row("role", str(status.get("role")))
    head.add_row("current version", str(status.get("version")))
    head.add_row("membership epoch", str(status.get("epoch")))
    head.add_row("uptime", f"{status.get('uptime_s', 0):.0f} s")
    manifest = status.get("manifest")
    if manifest:
        head.add_row("manifest", f"{manifest['digest'][:12]}  {manifest['tensors']} tensors, {manifest['buckets']} buckets, {manifest['bytes'] / 1e6:.2f} MB")
    console.print(head)

    engines = Table("name", "engine", "state", "version", "version from", "last seen", "health", title="engines")
    for e in status.get("engines") or []:
        eng = e.get("engine") or {}
        where = f"{eng.get('kind')} {eng.get('host', '')}:{eng.get('port', '')}" if "host" in eng else str(eng.get("kind"))
        health = e.get("health") or {}
        if "error" in health:
            health_text = f"[red]{health['error']}[/red]"
        else:
            health_text = ", ".join(f"{k}={v}" for k, v in health.items() if k in ("version", "paused", "stale", "receiving", "buckets_received"))
        state = e.get("state")
        colour = {"serving": "green", "pending": "yellow", "paused": "yellow", "stale": "red", "joining": "cyan"}.get(str(state), "white")
        origin = str(health.get("version_from") or "-")  # where the engine got the version it holds: "trainer sync" or "peer pull from <peer>"
        engines.add_row(str(e.get("name")), where, f"[{colour}]{state}[/{colour}]", str(e.get("version")), origin, f"{e.get('last_seen_s', 0):.1f} s ago", health_text)
    console.print(engines)

    joins = status.get("peer_joins") or {}
    if joins:
        table = Table("engine", "version", "result", "seconds to serve", "GB/s", "peers that failed", title="peer joins (daemon.peer_join)")
        for name, j in joins.items():
            result = f"[green]from {j.get('peer')}[/green]" if j.get("ok") else f"[red]{j.get('error')}[/red]"
            table.add_row(name, str(j.get("version")), result, f"{j.get('wall_s') or 0:.3f}", f"{j.get('gbps') or 0:.3f}", ", ".join(j.get("failed") or []))
        console.print(table)

    departed = status.get("departed") or {}
    if departed:
        table = Table("name", "last version", "when", "reason", title="departed engines")
        for name, d in departed.items():
            table.add_row(name, str(d.get("version")), time.strftime("%H:%M:%S", time.localtime(d.get("at", 0))), str(d.get("reason")))
        console.print(table)

    last = status.get("last_sync")
    if last:
        table = Table(title="last sync", show_header=False)
        report = last.get("report") or {}
        table.add_row("version", f"{last.get('version')}{' (catch-up)' if last.get('catch_up') else ''}")
        table.add_row("result", "[green]complete[/green]" if last.get("ok") else f"[red]incomplete: {last.get('error')}[/red]")
        if report:
            table.add_row("moved", f"{report.get('bytes', 0) / 1e6:.2f} MB, {report.get('tensors')} tensors, {report.get('buckets')} buckets to {report.get('engines')} engine(s)")
            table.add_row("wire", wire_text(report))
            table.add_row("senders", str(report.get("senders", 1)))
            secs = report.get("seconds") or {}
            table.add_row("seconds", ", ".join(f"{k} {v:.3f}" for k, v in secs.items() if isinstance(v, (int, float))))
            table.add_row("throughput", f"{report.get('gbps', 0):.3f} GB/s")
        table.add_row("wall", f"{last.get('seconds', 0):.3f} s")
        for name, why in (last.get("dropped") or {}).items():
            table.add_row(f"dropped {name}", str(why))
        for a in last.get("attempts") or []:
            table.add_row(f"attempt {a.get('attempt')} failed", f"{a.get('stage')}: {a.get('failed')}")
        console.print(table)

    history = status.get("history") or []
    if len(history) > 1:
        table = Table("version", "ok", "catch-up", "MB", "wire", "GB/s", "seconds", "dropped", title="recent syncs")
        for h in history[-10:]:
            table.add_row(
                str(h.get("version")), str(h.get("ok")), str(h.get("catch_up")), f"{(h.get('bytes') or 0) / 1e6:.2f}",
                wire_text(h) if h.get("ok") else "-", f"{h.get('gbps') or 0:.3f}", f"{h.get('seconds') or 0:.3f}", ", ".join(h.get("dropped") or []),
            )
        console.print(table)
