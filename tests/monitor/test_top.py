"""`disttrain top`: frames from run dirs written to the issue-17 schema, and its bounded waits."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from disttrain.cli.main import cli
from disttrain.monitor.live import read_live
from disttrain.monitor.top import breakdown_bar, watch

from .conftest import write_schema_run


def _capture() -> Console:
    return Console(record=True, width=160, force_terminal=True, color_system="standard",
                   file=io.StringIO())


def test_once_renders_every_rank_and_highlights_the_straggler(schema_run: Path) -> None:
    console = _capture()
    assert watch(schema_run, console, once=True) == 0
    styled = console.export_text(styles=True, clear=False).splitlines()
    text = console.export_text()
    rows = {int(line.split()[0]): line.split() for line in text.splitlines()
            if line.split() and line.split()[0].isdigit()}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[1][1:6] == ["job-0", "cuda:1", "40", "0.7100", "145.0"]   # host device step loss sps
    assert "rank 1 (host job-0, cuda:1) is the straggler" in " ".join(text.split())
    red = "\x1b[1;31m"   # the straggler's row is bold red, the others are not
    ansi_rows = [ansi for ansi, plain in zip(styled, text.splitlines())
                 if plain.split() and plain.split()[0].isdigit()]
    assert [line.startswith(red) for line in ansi_rows] == [False, True, False, False]


def test_the_bar_splits_the_step_by_its_parts() -> None:
    bar = breakdown_bar({"data_ms": 10, "compute_ms": 30, "comm_wait_ms": 60, "optimizer_ms": 0,
                         "other_ms": 0}, width=20)
    spans = [(s.style, s.end - s.start) for s in bar.spans]
    assert spans == [("yellow", 2), ("green", 6), ("magenta", 12)] and len(bar.plain) == 20
    assert len(breakdown_bar({"data_ms": 1, "compute_ms": 1, "comm_wait_ms": 1}, 10).plain) == 10


def test_a_run_dir_without_live_files_exits_2_after_the_timeout(tmp_path: Path) -> None:
    t0 = time.monotonic()
    result = CliRunner().invoke(cli, ["top", str(tmp_path / "never"), "--timeout", "0.5"])
    assert result.exit_code == 2 and "no rank has logged yet" in result.output
    assert "--run-dir" in result.output and "Traceback" not in result.output
    assert time.monotonic() - t0 < 30


def test_watch_ends_when_the_job_ends_and_when_it_goes_silent(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    write_schema_run(run_dir, world=2, slow=None, finished=False, done=False)
    assert not read_live(run_dir).done

    def finish() -> None:
        time.sleep(1.0)
        for r in (0, 1):   # the ranks' last writes say done, as at the end of fit
            path = run_dir / "live" / f"rank-{r}.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "done": True,
                                        "time": time.time()}))

    threading.Thread(target=finish, daemon=True).start()
    t0 = time.monotonic()
    assert watch(run_dir, _capture(), interval_s=0.2, start_timeout_s=5) == 0
    assert time.monotonic() - t0 < 30

    stale = tmp_path / "stale"   # killed without a summary: its last writes are old
    write_schema_run(stale, world=2, finished=False, done=False, now=time.time() - 100)
    console = _capture()
    assert watch(stale, console, interval_s=0.2, stale_s=50) == 1
    assert "no rank has written for" in console.export_text()


def test_an_earlier_runs_files_do_not_end_the_view_of_a_new_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    write_schema_run(run_dir, world=2, now=time.time() - 600)   # finished 10 minutes ago
    assert read_live(run_dir).done
    for name in ("summary.json", "live/rank-0.json", "live/rank-1.json", "live/straggler.json"):
        os.utime(run_dir / name, (time.time() - 600, time.time() - 600))
    (run_dir / "job.yaml").write_text("name: job\n")   # a new run starts in the same folder
    run = read_live(run_dir)
    assert run.empty and run.straggler is None
    result = CliRunner().invoke(cli, ["top", str(run_dir), "--timeout", "0.5"])
    assert result.exit_code == 2 and "no rank has logged yet" in result.output
