#!/usr/bin/env python3
"""Runs the shell blocks of the README, docs/ and the examples' READMEs that are marked
`<!-- runnable -->` (the line before the fence), each from the repository root in a fresh bash
with `set -euo pipefail`, after `runs/` is cleared: the commands work as pasted after the
README's first command (scripts/fresh-clone.sh calls this in its copy, after the demo).
To keep it cheap, a line starting `moult run ` gets `--steps 1`. Prints each block's time;
exits 1 on the first block that fails, with its output.
    python3 scripts/doc-blocks.py [--list] [FILE...]   # FILE: only the blocks of these pages"""
import glob, os, re, shutil, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "<!-- runnable -->"


def blocks():
    files = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))
    files += sorted(glob.glob("examples/*/README.md", root_dir=ROOT))
    for f in files:
        lines = open(os.path.join(ROOT, f), encoding="utf-8").read().split("\n")
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            if not re.match(r"^```(bash|sh)$", lines[i + 1].strip()):
                sys.exit(f"{f}:{i + 1}: {MARK} must stand right before a ```bash fence")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
            yield f"{f}:{i + 2}", lines[i + 2 : end]


def cheap(line):
    """`moult run X # note` -> `moult run X --steps 1 # note`."""
    if not line.startswith("moult run "):
        return line
    code, hash_, note = line.partition(" #")
    return f"{code.rstrip()} --steps 1" + (f"  #{note}" if hash_ else "")


def main():
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    found = [(w, b) for w, b in blocks() if not only or w.split(":")[0] in only]
    if "--list" in sys.argv:
        for where, body in found:
            print(where, f"({len(body)} lines)")
        return
    if not found:
        sys.exit("doc-blocks: no block is marked runnable")
    for where, body in found:
        shutil.rmtree(os.path.join(ROOT, "runs"), ignore_errors=True)
        script = "set -euo pipefail\n" + "\n".join(cheap(l) for l in body) + "\n"
        start = time.time()
        done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900)
        took = time.time() - start
        if done.returncode != 0:
            print(f"doc-blocks: {where} failed (exit {done.returncode}) after {took:.0f}s:\n{script}")
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            sys.exit(1)
        print(f"doc-blocks: {where} ran in {took:.0f}s")
    print(f"doc-blocks: {len(found)} runnable blocks ran")


main()
