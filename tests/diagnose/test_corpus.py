"""The accuracy table in docs/troubleshooting.md is what the corpus gives today."""

from __future__ import annotations

import corpus_table


def test_docs_show_the_current_accuracy_table() -> None:
    assert corpus_table.docs_table() == corpus_table.table(), (
        "run `python tests/diagnose/corpus_table.py --write`")


def test_every_fixture_is_right_as_captured() -> None:
    assert [m for m in corpus_table.misses() if m[1] == "as captured"] == []
