# SPDX-License-Identifier: Apache-2.0
"""What the docs list that the code also knows: the overlay files (upstream.lock) and
build.py's exit codes; and that their links lead somewhere. (The README's backend
selection table is checked by tests/kernels/attention/test_attention_selector_sparse.py.)"""

import ast
import re
import tomllib
from pathlib import Path

from tools import common

ROOT = Path(__file__).resolve().parents[2]


def block(path: Path, name: str) -> list[str]:
    text = path.read_text()
    begin, end = f"<!-- {name}: begin -->\n", f"<!-- {name}: end -->"
    assert begin in text and end in text, f"{path.name} lacks the {name} markers"
    return text.split(begin, 1)[1].split(end, 1)[0].strip().splitlines()


def test_overlay_files_listed():
    lock = tomllib.loads((ROOT / "upstream.lock").read_text())
    rows = block(ROOT / "docs" / "overlay.md", "overlay files")[2:]
    listed = {}
    for row in rows:
        # file | kind | why | upstream issue or PR | remove when: no cell empty
        m = re.fullmatch(r"\| `([^`]+)` \| (new|replaced)( \| [^|]*[^| ][^|]*){3} \|", row)
        assert m, row
        listed[m[1]] = m[2]
    assert listed == {rel: "new" if e.get("new") is True else "replaced"
                      for rel, e in lock["overlay"].items()}


def test_exit_codes_listed():
    doc = (ROOT / "docs" / "overlay.md").read_text().split("## Exit codes", 1)[1]
    table = {int(m[1]) for m in re.finditer(r"^\| (\d+) \|", doc, re.M)}
    codes = {0, 2} | {v for k, v in vars(common).items() if k.startswith("EXIT_")}
    assert table == codes
    # build.py's docstring (its --help) names the same codes
    usage = ast.get_docstring(ast.parse((ROOT / "build.py").read_text()))
    assert {int(n) for n in re.findall(r"(\d+) [a-z]", usage.split("Exit codes:")[1])} == codes


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped (word
    characters, spaces and hyphens kept), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """A Markdown file's heading anchors, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), re.M):
        s = slug(m[1])
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out


def test_doc_links_resolve():
    """Every relative link of README.md and docs/ names a file that exists and, with
    a #fragment, one of its headings: results move and headings get renamed."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, fragment = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
