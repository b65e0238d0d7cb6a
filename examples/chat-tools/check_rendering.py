"""Checks that what the loopback server recorded for agent.py's episodes is, token for token, what
make_model.py trains on: run episodes with `moult agents`, then

    python examples/chat-tools/check_rendering.py EPISODES.jsonl

Each episode in the base format (one segment; an answer, or one call then an answer) is rebuilt
from its task, its call and its answer with make_model.py's renderer (transformers'
`apply_chat_template`) and compared with the recorded token ids and loss mask. Episodes whose
replies are off the format are counted and skipped. Exits 1 on any difference.
"""

import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_model  # noqa: E402


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python check_rendering.py EPISODES.jsonl")
    renderer = make_model.Renderer(make_model.tokenizer())
    answer = re.compile(re.escape(make_model.ANSWER).replace(re.escape("{}"), r"(\d)"))
    counts, first_replies = collections.Counter(), collections.Counter()
    with open(sys.argv[1]) as f:
        episodes = [json.loads(line) for line in f if line.strip()]
    for ep in episodes:
        info, segments = ep.get("info") or {}, ep.get("segments") or []
        calls = info.get("calls", [])
        first_replies[calls[0] if calls else "answer"] += 1
        said = answer.fullmatch((info.get("answer") or "").strip())
        if len(segments) != 1 or len(calls) > 1 or (calls and calls[0] not in make_model.DAY) or not said:
            counts["off the format, skipped"] += 1
            continue
        want = renderer.episode(ep["task"], calls[0] if calls else None, int(said[1]))
        got = (segments[0]["token_ids"], segments[0]["loss_mask"])
        if got == want:
            counts["identical"] += 1
        else:
            counts["DIFFERENT"] += 1
            print(f"episode {ep.get('index')}: recorded {renderer.tok.decode(got[0])!r}")
            print(f"  make_model.py renders {renderer.tok.decode(want[0])!r}")
    print(f"{len(episodes)} episodes: {dict(counts)}; first replies: {dict(first_replies)}")
    print(f"mean reward {sum(ep.get('reward', 0.0) for ep in episodes) / len(episodes):.3f}")
    sys.exit(1 if counts["DIFFERENT"] or not counts["identical"] else 0)


if __name__ == "__main__":
    main()
