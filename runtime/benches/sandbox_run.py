"""What a `moult.sandbox.run` call costs: each call against the same program started directly,
measured in one invocation (docs/benchmarks.md, "Episodes: the cost of a jail"). Run from the
repository root, with the jail maker to measure (`moult-jail`, or `moult`):

    MOULT_BIN=$CARGO_TARGET_DIR/release/moult-jail PYTHONPATH=runtime/python python3 runtime/benches/sandbox_run.py
"""

import statistics
import subprocess
import sys
import time

import moult

ROUNDS = 20
PROGRAMS = [
    ("`python -c pass`", "pass"),
    ("`python` summing a million numbers", "print(sum(range(1_000_000)))"),
]


def timed(fn):
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    print(f"| program | direct (ms) | sandbox.run (ms) | ratio |  ({ROUNDS} rounds, medians)")
    print("| --- | --- | --- | --- |")
    for name, code in PROGRAMS:
        direct = timed(lambda: subprocess.run([sys.executable, "-c", code], check=True, capture_output=True))
        def jailed():
            r = moult.sandbox.run(code, timeout=60)
            assert r.ok, r
        sandboxed = timed(jailed)
        print(f"| {name} | {direct * 1e3:.1f} | {sandboxed * 1e3:.1f} | {sandboxed / direct:.1f}x |")


main()
