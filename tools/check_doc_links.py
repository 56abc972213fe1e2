#!/usr/bin/env python3
"""Checks the relative links of Markdown files: every linked path exists and
every #anchor names a heading of its target (GitHub's heading slugs).
Standard library only.

    python3 tools/check_doc_links.py README.md docs/*.md

Prints each broken link and exits 1 if there is any."""
import os
import re
import sys


def slug(heading):
    """GitHub's anchor for a heading: lower case, spaces to '-', punctuation dropped."""
    out = []
    for ch in heading.strip().lower():
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def anchors(path):
    found, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(1))
                n = seen.get(s, 0)
                seen[s] = n + 1
                found.add(s if n == 0 else f"{s}-{n}")
    return found


def broken_links(path):
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):
            continue  # http:, https:, mailto:
        target, _, anchor = link.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(resolved):
            yield f"{path}: {link}: no such file"
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            yield f"{path}: {link}: no heading #{anchor} in {resolved}"


def main(paths):
    bad = [b for p in paths for b in broken_links(p)]
    for b in bad:
        print(b)
    print(f"{len(bad)} broken link(s) in {len(paths)} file(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
