# SPDX-License-Identifier: Apache-2.0
"""docs/results.md holds measured figures only: every figure in its tables appears in
the JSON report its section links (benchmarks/results/NAME.json), as the page rounds
it. A section whose tables hold figures names at least one report; prose carries no
figures (the page says so), so the tables are what is checked."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results.md"
REPORT = re.compile(r"\]\(\.\./benchmarks/results/([\w.\-]+\.json)\)")
FIGURE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) per heading of any level; a body ends at the next heading."""
    parts = re.split(r"^(#{1,6} .+)$", text, flags=re.M)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def table_figures(body: str) -> list[str]:
    """The numbers of a section's table cells, the first column (the row's label) and
    the header rows left out. Backquoted text (names, commands) is not a figure."""
    out = []
    lines = body.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        if i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: ") and "-" in lines[i + 1]:
            continue  # a header row
        cells = [c.strip() for c in line.strip("|").split("|")][1:]
        for cell in cells:
            cell = re.sub(r"`[^`]*`|\[[^\]]*\]\([^)]*\)", lambda m: m[0].split("](")[0]
                          if m[0].startswith("[") else "", cell)
            out += FIGURE.findall(cell)
    return out


def numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


def found(figure: str, values: list[float]) -> bool:
    """A JSON value that rounds to the figure at the figure's decimals."""
    decimals = len(figure.partition(".")[2])
    tol = 0.5 * 10 ** -decimals + 1e-9
    f = float(figure)
    return any(abs(v - f) <= tol for v in values)


def unmatched(text: str) -> list[str]:
    bad = []
    for heading, body in sections(text):
        figures = table_figures(body)
        if not figures:
            continue
        reports = REPORT.findall(body)
        if not reports:
            bad.append(f"{heading}: tables with figures but no report linked")
            continue
        values = [n for r in reports
                  for n in numbers(json.loads((ROOT / "benchmarks" / "results" / r).read_text()))]
        bad += [f"{heading}: {f} not in {', '.join(reports)}" for f in figures
                if not found(f, values)]
    return bad


def test_every_figure_is_in_its_report():
    bad = unmatched(PAGE.read_text())
    assert not bad, "\n".join(bad)


def test_a_wrong_figure_fails():
    """The check itself: a figure changed in the last decimal is found missing."""
    text = PAGE.read_text()
    for heading, body in sections(text):
        figures = [f for f in table_figures(body) if "." in f]
        if figures and REPORT.search(body):
            f = figures[0]
            wrong = f[:-1] + str((int(f[-1]) + 5) % 10)
            changed = body.replace(f"| {f}", f"| {wrong}", 1).replace(f" {f} ", f" {wrong} ", 1)
            if changed != body:
                assert unmatched(text.replace(body, changed, 1))
                return
    raise AssertionError("no figure to change")


def test_reports_exist_and_are_linked():
    """Every report under benchmarks/results/ is one the page links, and each link resolves."""
    linked = set(REPORT.findall(PAGE.read_text()))
    present = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    assert linked <= present, linked - present
    assert present <= linked, present - linked
