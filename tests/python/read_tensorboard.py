"""Reads every scalar of a run's TensorBoard event files with TensorBoard's own reader and prints
them as JSON: {tag: [[step, value], ...]} (the test compares them with metrics.jsonl)."""

import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(logdir):
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
