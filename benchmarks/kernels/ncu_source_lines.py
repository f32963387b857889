# SPDX-License-Identifier: Apache-2.0
"""Per source line of a Triton kernel: stall samples and shared-memory wavefronts
from Nsight Compute's source page.

    ncu -k regex:_sparse_mla_kernel -c 1 --section SourceCounters --page source \
        --print-source sass,cuda --csv python -m benchmarks.kernels.sparse_mla_one_launch \
        4096 64 bf16 > src.csv
    python -m benchmarks.kernels.ncu_source_lines src.csv triton_sparse_mla.py [TOP]
"""

import collections
import csv
import io
import re
import sys

METRICS = ("Warp Stall Sampling (All Samples)", "stall_barrier", "stall_wait",
           "stall_short_sb", "stall_long_sb", "L1 Wavefronts Shared",
           "L1 Wavefronts Shared Excessive")


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def per_line(csv_text: str, source_file: str):
    """{line: Counter of METRICS} and {line: source text} for one source file."""
    for block in re.split(r'\n(?="File Path")', csv_text):
        head, _, body = block.partition("\n")
        if not head.startswith('"File Path"') or source_file not in head:
            continue
        rows = list(csv.reader(io.StringIO(body.partition("\n")[2])))
        col = {name: i for i, name in enumerate(rows[0])}
        totals, text, line = collections.defaultdict(collections.Counter), {}, None
        for row in rows[1:]:
            if row[0].strip():  # a source line; the SASS rows under it follow
                line = int(row[0])
                text[line] = row[1]
            for name in METRICS:
                totals[line][name] += number(row[col[name]])
        return totals, text
    raise SystemExit(f"{source_file} is not in the profile")


def main():
    path, source_file = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    with open(path) as f:
        totals, text = per_line(f.read(), source_file)
    samples = sum(c[METRICS[0]] for c in totals.values()) or 1.0
    print(f"{samples:.0f} stall samples; per line: % of samples, then stalls (barrier / wait "
          "/ short scoreboard / long scoreboard), shared wavefronts (excess)")
    for line, c in sorted(totals.items(), key=lambda kv: -kv[1][METRICS[0]])[:top]:
        print(f"L{line:<4} {100 * c[METRICS[0]] / samples:5.1f}%  {c['stall_barrier']:.0f} / "
              f"{c['stall_wait']:.0f} / {c['stall_short_sb']:.0f} / {c['stall_long_sb']:.0f}  "
              f"{c['L1 Wavefronts Shared']:.0f} ({c['L1 Wavefronts Shared Excessive']:.0f})  "
              f"{text.get(line, '')[:80]}")


if __name__ == "__main__":
    main()
