#!/usr/bin/env python3
"""Every relative link of the README, docs/ and the examples' READMEs resolves: the file or
folder exists, and an anchor (`page.md#section`, `#section`) names a heading of that page, as
GitHub makes anchors from headings. Run from anywhere:
    python3 scripts/check-docs.py
Prints each broken link with its file and line, and exits 1 when there is one."""
import os, re, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages():
    yield os.path.join(ROOT, "README.md")
    for base in ("docs", "examples", "operator", "charts", "crds", "tests"):
        for dp, dn, fn in os.walk(os.path.join(ROOT, base)):
            dn[:] = [d for d in dn if d not in ("node_modules", "target", ".venv") and not d.startswith(".")]
            yield from (os.path.join(dp, f) for f in sorted(fn) if f.endswith(".md"))


def prose(path):
    """(line number, text) of the lines outside code blocks, inline code removed."""
    fenced = False
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, re.sub(r"`[^`]*`", "", line)


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


ANCHORS = {}


def anchors(path):
    if path not in ANCHORS:
        seen, found = {}, set()
        fenced = False
        for line in open(path, encoding="utf-8"):
            if FENCE.match(line):
                fenced = not fenced
                continue
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m and not fenced:
                s = slug(m.group(1).replace("`", ""))
                k = seen.get(s, 0)
                seen[s] = k + 1
                found.add(s if k == 0 else f"{s}-{k}")
            found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
        ANCHORS[path] = found
    return ANCHORS[path]


def main():
    broken, checked = [], 0
    for page in pages():
        for n, line in prose(page):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                checked += 1
                file, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
                where = f"{os.path.relpath(page, ROOT)}:{n}: {target}"
                if not os.path.exists(dest):
                    broken.append(f"{where}: {os.path.relpath(dest, ROOT)} does not exist")
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    broken.append(f"{where}: no heading makes #{anchor}")
    for b in broken:
        print(b)
    print(f"check-docs: {checked} relative links, {len(broken)} broken")
    sys.exit(1 if broken else 0)


main()
