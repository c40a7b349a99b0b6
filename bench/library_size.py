"""The library's size, and how much of its growth since a round began each issue brought.

Why: issue 40's bar counts the library "before what the other issues of this round add". Each
commit's net lines in the library (added minus deleted, `git log --numstat`, without `trainer/`,
`benchmark/`, `plan/`) go to the issues its message names ("issue 42"); a commit that names none
goes by the first rule below its subject matches (printed with `--untagged`, so a reader can check
every one). The bar's measure is the round's start plus the net of issue 40's commits (and of
those no rule places), that is: today's library less what the other issues added.

    python bench/library_size.py [--since d85175a] [--issue 40] [--untagged]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess

LIBRARY = re.compile(r"ckpt_engine/(?!(trainer|benchmark|plan)/).*\.py$")
ISSUE = re.compile(r"[Ii]ssues? (\d+(?:(?:, | and |/)\d+)*)")
"""An issue or a list of them (`issues 40, 42`, `issues 39 and 42`): each is named."""

# Untagged commits, by subject, first match wins. Issue 40's own phrases come first: its cuts
# name the structure they change; the other issues' name their feature.
RULES: list[tuple[str, str]] = [
    ("40", r"one implementation per device kind|objects built from the sharded model|a package per engine|"
           r"one declared object|lazy registry|docstrings?\b|said once|\bdead\b|\bmypy\b|\bruff\b|one launcher|"
           r"one take_known|import groups|rich and tqdm|one retry when|one reading of|ControlLimits|method table|"
           r"frames_of|WeightSource.device is a plain|one sync both vLLM handles share"),
    ("42", r"[Ii]nstalled|restart|rejoin|\bseal\b|covered only|deadline"),
    ("41", r"\bFP8\b|\bfp8\b"),
    ("43", r"\belastic\b|\bnixl\b|\bpeer\b|\bjoiner|\b[Pp]ull\b"),
    ("39", r"vLLM on CUDA|colocated|copy_kernel|\bcopies\b|\bCUDA\b|\bGPU\b|direct load|prefix|in process"),
    ("42", r"[Cc]heck|reliab|flake|version|fault|stale|refuses|\bfail|\bbound|[Pp]lan cache|\bport\b"),
]


def commits(since: str) -> list[tuple[str, str, int]]:
    """(hash, message, net library lines) of every commit after `since` on HEAD, merges left out
    (their sides are counted)."""
    out = subprocess.check_output(
        ["git", "log", "--no-merges", "--no-renames", "--numstat", "--format=@@%H%x00%B%x00", f"{since}..HEAD"], text=True
    )
    found = []
    for chunk in out.split("@@")[1:]:
        sha, message, stats = chunk.split("\x00", 2)
        net = 0
        for line in stats.strip().splitlines():
            added, deleted, path = line.split("\t")
            if added != "-" and LIBRARY.match(path):
                net += int(added) - int(deleted)
        found.append((sha, message, net))
    return found


def owner(message: str) -> tuple[str, bool]:
    """The issues a commit belongs to ("39,42"), and whether its message named them."""
    named = sorted({n for found in ISSUE.findall(message) for n in re.findall(r"\d+", found)}, key=int)
    if named:
        return ",".join(named), True
    subject = message.strip().splitlines()[0] if message.strip() else ""
    for issue, rule in RULES:
        if re.search(rule, subject):
            return issue, False
    return "?", False


def library_lines(rev: str) -> tuple[int, int]:
    """(lines, files) of the library at `rev`."""
    names = [n for n in subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, "ckpt_engine"], text=True).split() if LIBRARY.match(n)]
    lines = sum(subprocess.check_output(["git", "show", f"{rev}:{n}"]).count(b"\n") for n in names)
    return lines, len(names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--since", default="d85175a", help="the round's first commit (issue 40 was filed on it)")
    parser.add_argument("--issue", default="40", help="the issue whose measure is printed")
    parser.add_argument("--untagged", action="store_true", help="list every commit placed by a rule, with its net lines")
    args = parser.parse_args()
    start, start_files = library_lines(args.since)
    now, now_files = library_lines("HEAD")
    by_owner: collections.Counter[str] = collections.Counter()
    untagged = []
    for sha, message, net in commits(args.since):
        who, named = owner(message)
        by_owner[who] += net
        if not named:
            untagged.append((net, who, sha[:8], message.strip().splitlines()[0][:110]))
    print(f"library at {args.since}: {start} lines in {start_files} files; at HEAD: {now} lines in {now_files} files")
    print("net lines since, by the issues the commits belong to:")
    for who, net in sorted(by_owner.items(), key=lambda kv: -abs(kv[1])):
        print(f"  {who:>8}  {net:+7d}")
    mine = sum(net for who, net in by_owner.items() if who in (args.issue, "?"))
    shared = sum(net for who, net in by_owner.items() if "," in who and args.issue in who.split(","))
    print(f"issue {args.issue}'s measure (the start, its own commits and the unplaced ones): {start + mine} lines; "
          f"with the commits it shares with another issue: {start + mine + shared}")
    if args.untagged:
        print("commits placed by a rule (net, owner, commit, subject):")
        for row in sorted(untagged, key=lambda r: -abs(r[0])):
            print(f"  {row[0]:+6d} {row[1]:>3} {row[2]} {row[3]}")


if __name__ == "__main__":
    main()
