"""Render conversations with Hugging Face transformers' chat-template renderer (the reference our
minijinja rendering must match byte for byte).

Usage: python render_chat_templates.py CASES_JSON OUT_JSON

CASES_JSON: {"templates": {name: path}, "cases": [{"name", "messages", "tools"?,
"add_generation_prompt", "kwargs"}]}. OUT_JSON: {template: {case: {"text": ...} or
{"error": ..., "raised": ...}}}, where "raised" is the message of the template's own
raise_exception and null for any other error.
"""

import json
import sys

from transformers.utils.chat_template_utils import render_jinja_template


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = {}
    for name, path in spec["templates"].items():
        with open(path) as f:
            template = f.read()
        results = {}
        for case in spec["cases"]:
            try:
                rendered, _ = render_jinja_template(
                    conversations=[case["messages"]],
                    tools=case.get("tools"),
                    chat_template=template,
                    add_generation_prompt=case["add_generation_prompt"],
                    **case.get("kwargs", {}),
                )
                results[case["name"]] = {"text": rendered[0]}
            except Exception as e:  # noqa: BLE001 - the error itself is the expected output
                results[case["name"]] = {
                    "error": f"{type(e).__name__}: {e}",
                    # Exactly jinja2's TemplateError (not a subclass): the template's own
                    # raise_exception(message), whose message a faithful renderer repeats.
                    "raised": str(e) if type(e).__name__ == "TemplateError" else None,
                }
        out[name] = results
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
