"""`ckpt-engine` command line: bench | serve | status | demo.

Each subcommand lives in its own module and parses its own arguments, so this file only routes.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "bench": ("ckpt_engine.benchmark.cli", "main", "measure raw broadcast, naive per-tensor and ckpt-engine syncs"),
    "serve": ("ckpt_engine.daemon.cli", "serve_main", "run the weight-sync daemon"),
    "status": ("ckpt_engine.daemon.cli", "status_main", "show a daemon's engines, versions and last sync"),
    "demo": ("ckpt_engine.trainer.demo", "main", "run a short fully-async RL job on CPU"),
    "plan": ("ckpt_engine.plan.cli", "main", "predict a sync's time on a given cluster (stages, bottleneck)"),
}
CLI_EXTRA = ("rich", "tqdm")
"""What the `cli` extra installs: the bench's and the daemon status's tables and progress bar."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        lines = ["usage: ckpt-engine {" + ",".join(COMMANDS) + "} [options]", ""]
        lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
        print("\n".join(lines))
        return 0 if args and args[0] in ("-h", "--help") else 2
    module, func, _ = COMMANDS[args[0]]
    from ckpt_engine.config import ConfigError

    try:
        return int(getattr(importlib.import_module(module), func)(args[1:]) or 0)
    except ConfigError as exc:  # bad input that a subcommand did not catch: one line, no traceback
        print(f"ckpt-engine {args[0]}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in CLI_EXTRA:
            raise
        print(f"ckpt-engine {args[0]} needs {missing}, which the `cli` extra installs: pip install 'ckpt-engine[cli]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
