"""`disttrain report`: report.png and the table over run dirs written to the issue-17 schema."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from disttrain.cli.main import cli
from disttrain.monitor.report import fmt_value, load_report, plot_report, summary_tables
from disttrain.train.phases import PHASES

from .conftest import write_schema_run


def _table_text(run_dir: Path) -> str:
    console = Console(record=True, width=200)
    console.print(summary_tables(load_report(run_dir)))
    return console.export_text()


def test_report_png_and_the_tables_figures_match_summary_json(schema_run: Path) -> None:
    result = CliRunner().invoke(cli, ["report", str(schema_run)])
    assert result.exit_code == 0, result.output
    png = schema_run / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    summary = json.loads((schema_run / "summary.json").read_text())
    text = _table_text(schema_run)
    for key in ("final_loss", "test_accuracy", "samples_per_s", "steps", "world_size"):
        fmt = ".4f" if "loss" in key or "accuracy" in key else (".1f" if key == "samples_per_s" else "d")
        assert fmt_value(summary[key], fmt) in text, key
    lines = {int(line.split()[0]): line.split() for line in text.splitlines()
             if line.split() and line.split()[0].isdigit() and "job-" in line}
    assert sorted(lines) == [r["rank"] for r in summary["ranks"]]
    for r in summary["ranks"]:   # rank host device samples/s step data compute comm optim other
        row = lines[r["rank"]]
        assert row[1:3] == [r["host"], r["device"]]
        assert row[3:] == [f"{r[k]:.1f}" for k in ("samples_per_s", "step_ms", *PHASES)]
    assert summary["straggler"]["message"].split(":")[0] in " ".join(text.split())


def test_json_carries_the_summarys_ranks_and_verdict(schema_run: Path) -> None:
    result = CliRunner().invoke(cli, ["report", str(schema_run), "--json"])
    assert result.exit_code == 0, result.output
    out, summary = json.loads(result.output), json.loads((schema_run / "summary.json").read_text())
    assert out["ranks"] == summary["ranks"] and out["straggler"] == summary["straggler"]
    assert out["final_loss"] == summary["final_loss"] and Path(out["report_png"]).is_file()


def test_a_run_without_a_straggler_or_timing_still_reports(tmp_path: Path) -> None:
    run_dir = tmp_path / "even"
    write_schema_run(run_dir, world=2, slow=None)
    summary = json.loads((run_dir / "summary.json").read_text())
    del summary["ranks"], summary["straggler"]   # a summary from before issue 17
    (run_dir / "summary.json").write_text(json.dumps(summary))
    rep = load_report(run_dir)
    assert [r["rank"] for r in rep.ranks] == [0, 1] and rep.straggler is None
    assert rep.ranks[0]["compute_ms"] == 30.0   # the means of metrics.jsonl's rows
    assert plot_report(rep).is_file()
    assert "no straggler" in _table_text(run_dir)


def test_a_folder_that_is_not_a_run_exits_2_naming_the_file(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "metrics.jsonl: not found" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "report.png").exists()
    write_schema_run(tmp_path / "live", finished=False)
    result = runner.invoke(cli, ["report", str(tmp_path / "live")])
    assert result.exit_code == 2 and "summary.json: not found" in result.output
    (tmp_path / "live" / "summary.json").write_text("{not json")
    result = runner.invoke(cli, ["report", str(tmp_path / "live")])
    assert result.exit_code == 2 and "summary.json: not JSON" in result.output
