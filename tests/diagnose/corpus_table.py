"""The doctor's accuracy on its own corpus, per cause: the table in docs/troubleshooting.md.

    python tests/diagnose/corpus_table.py          # print the table
    python tests/diagnose/corpus_table.py --write  # rewrite it in docs/troubleshooting.md

The corpus is every fixture in logs/ (its expected cause from logs/README.md) and each
fixture mangled as pastes mangle logs (mangle.MANGLES: wrapped at 80 and 120 columns, one
more prefix, another rank interleaved, Windows paths). test_corpus_table checks that the
docs show what this computes, so the numbers stay true.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from mangle import MANGLES  # noqa: E402

from disttrain.diagnose.logs import diagnose  # noqa: E402

DOCS = HERE.parent.parent / "docs" / "troubleshooting.md"
BEGIN, END = "<!-- corpus-table:begin -->", "<!-- corpus-table:end -->"


def expected() -> dict[str, str]:
    """Fixture name -> expected cause, from logs/README.md."""
    out = {}
    for line in (HERE / "logs" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0].endswith(".log"):
            out[cells[0]] = cells[1]
    return out


def misses() -> list[tuple[str, str, str, str]]:
    """(fixture, mangle, expected, got) for every wrong answer on the corpus."""
    out = []
    for name, cause in sorted(expected().items()):
        text = (HERE / "logs" / name).read_text()
        for mangle, f in {"as captured": lambda t: t, **MANGLES}.items():
            got = diagnose(f(text)).cause
            if got != cause:
                out.append((name, mangle, cause, got))
    return out


def table() -> str:
    """The markdown table: per cause, fixtures right / all, mangled variants right / all."""
    exp = expected()
    wrong = misses()
    files, variants = Counter(exp.values()), Counter()
    for cause in exp.values():
        variants[cause] += len(MANGLES)
    bad_files = Counter(c for _, m, c, _ in wrong if m == "as captured")
    bad_variants = Counter(c for _, m, c, _ in wrong if m != "as captured")
    rows = ["| cause | fixtures right | mangled variants right | misses |",
            "| --- | --- | --- | --- |"]
    for cause in sorted(files):
        miss = ", ".join(f"{n} ({m} -> {g})" for n, m, c, g in wrong if c == cause) or "-"
        rows.append(f"| `{cause}` | {files[cause] - bad_files[cause]}/{files[cause]} | "
                    f"{variants[cause] - bad_variants[cause]}/{variants[cause]} | {miss} |")
    n_files, n_var = sum(files.values()), sum(variants.values())
    rows.append(f"| all | {n_files - sum(bad_files.values())}/{n_files} | "
                f"{n_var - sum(bad_variants.values())}/{n_var} | |")
    return "\n".join(rows)


def docs_table() -> str:
    text = DOCS.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def write() -> None:
    text = DOCS.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOCS.write_text(text[:start] + "\n" + table() + "\n" + text[end:])


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    else:
        print(table())
