"""Send images through the loopback server with the real `openai` and `anthropic` SDKs, as a
vision-language agent would: two turns per session, an image in each user turn (OpenAI
`image_url` parts with data URLs, Anthropic base64 `image` blocks), the second turn continuing the
first with the model's reply.

Usage: python vl_sdk_client.py BASE_URL IMAGE_A IMAGE_B

Sessions `openai-vl` and `anthropic-vl`. Prints one JSON line: each session's replies.
"""

import base64
import json
import sys

import anthropic
import openai

BASE, IMAGE_A, IMAGE_B = sys.argv[1:4]


def b64(path):
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode("ascii")


def openai_session():
    client = openai.OpenAI(base_url=f"{BASE}/s/openai-vl/v1", api_key="moult", max_retries=0)
    messages, replies = [], []
    for path, text in [(IMAGE_A, "What is in this picture?"), (IMAGE_B, "And in this one?")]:
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(path)}"}},
                    {"type": "text", "text": text},
                ],
            }
        )
        r = client.chat.completions.create(model="tiny", messages=messages, temperature=1.0, seed=7, max_tokens=6)
        reply = r.choices[0].message.content
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies


def anthropic_session():
    client = anthropic.Anthropic(base_url=f"{BASE}/s/anthropic-vl", api_key="moult", max_retries=0)
    messages, replies = [], []
    for path, text in [(IMAGE_B, "Describe it."), (IMAGE_A, "Now this one.")]:
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(path)}},
                    {"type": "text", "text": text},
                ],
            }
        )
        # Greedy (temperature 0, which this SDK takes only in the body): the Messages API has no
        # seed, and a sampled reply cut at max_tokens inside a character does not come back as
        # the same tokens, so its next turn starts a new segment (rightly; the test would flake).
        r = client.messages.create(model="tiny", messages=messages, max_tokens=6, extra_body={"temperature": 0.0})
        reply = "".join(b.text for b in r.content if b.type == "text")
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies


print(json.dumps({"openai-vl": openai_session(), "anthropic-vl": anthropic_session()}))
