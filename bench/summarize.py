"""Print the modes of one `ckpt-engine bench --json` file, a line each (the device scripts' summary).

    python bench/summarize.py bench/results/<run>/<name>.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    try:
        with open(path) as f:
            s = json.load(f)
    except (OSError, ValueError) as e:
        print("no result:", e)
        return
    for k, m in s["modes"].items():
        extra = "".join(f" {f}={m[f]:.4g}" for f in ("wire_fraction", "changed_fraction", "encode_s", "apply_s", "cast_s", "plain_cast_s") if f in m)
        print(f"  {k:28s} {m['best_s']:.4f}s  time/raw {m.get('ratio_to_raw', 0):.3f}{extra}")
    print("  correct:", s.get("correct"), s.get("base_bytes", ""))


if __name__ == "__main__":
    main(sys.argv[1])
