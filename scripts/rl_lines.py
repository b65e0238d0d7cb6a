#!/usr/bin/env python3
"""The size of moult's RL path as docs/architecture.md describes it, counted the way frameworks
compare themselves: non-blank, non-comment lines of runtime/src minus the inference engine
(engine/, model/, vision/), tests excluded (`tests.rs` files, `#[cfg(test)]` modules). Also
prints each room's size and the functions that still return `Result<_, String>`. Run from the
repository root:
    python3 scripts/rl_lines.py [--budget 15000]
Exits 1 when the count is over the budget."""
import os, re, sys

ENGINE = {"engine", "model", "vision"}


def code_lines(path):
    n, depth, skip_at, in_block, pending = 0, 0, None, False, False
    for raw in open(path, encoding="utf-8", errors="replace"):
        line = raw.strip()
        if in_block:
            if "*/" not in line:
                continue
            in_block, line = False, line.split("*/", 1)[1].strip()
        if line.startswith("/*"):
            in_block = "*/" not in line
            continue
        if not line or line.startswith("//"):
            continue
        if line.startswith("#[cfg(test)]"):
            pending = True
            continue
        opens, closes = line.count("{"), line.count("}")
        if pending and skip_at is None:
            skip_at, pending = depth, False
        depth += opens - closes
        if skip_at is not None:
            if depth <= skip_at and (opens or closes):
                skip_at = None
            continue
        n += 1
    return n


def main():
    budget = int(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 15000
    src = "runtime/src"
    if not os.path.isdir(src):
        sys.exit("run from the repository root (runtime/src not found)")
    rooms, strings = {}, 0
    for dp, dn, fn in os.walk(src):
        dn[:] = [d for d in dn if d != "tests"]
        for f in fn:
            if not f.endswith(".rs") or f == "tests.rs":
                continue
            p = os.path.join(dp, f)
            room = os.path.relpath(p, src).split(os.sep)[0]
            if room in ENGINE:
                continue
            rooms[room] = rooms.get(room, 0) + code_lines(p)
            text = open(p, encoding="utf-8", errors="replace").read().split("#[cfg(test)]")[0]
            strings += len(re.findall(r"->\s*(?:std::result::)?Result<[^;{]*,\s*String>", text))
    total = sum(rooms.values())
    print(f"RL path: {total} lines (budget {budget})")
    for room, n in sorted(rooms.items(), key=lambda x: -x[1]):
        print(f"  {room:24s} {n}")
    print(f"functions returning Result<_, String>: {strings}")
    sys.exit(0 if total <= budget else 1)


main()
