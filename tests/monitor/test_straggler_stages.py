"""The straggler verdict under pipeline parallel (issue 26 item 4, "the straggler view shows
stages"): each rank's place in the mesh in the verdict and in the views, and a rank compared
with the ranks of its own stage only (`train/straggler.py`'s docstring says why). One
process: entries shaped like summary.json's `ranks`; the real runs are in
tests/monitor/test_straggler_pipeline_run.py."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console

from disttrain.monitor.live import LiveRun
from disttrain.monitor.top import frame
from disttrain.train.straggler import StragglerWatch, find_straggler, no_verdict, place_label, stage_of
from disttrain.train.telemetry import mesh_place


def _rank(rank: int, compute: float = 10.0, comm: float = 1.0, data: float = 0.2,
          mesh: dict[str, list[int]] | None = None) -> dict[str, Any]:
    step = data + compute + comm + 2.0 + 0.3
    entry: dict[str, Any] = {"rank": rank, "host": f"job-{rank}", "device": "cuda:0",
                             "step_ms": step, "data_ms": data, "compute_ms": compute,
                             "comm_wait_ms": comm, "optimizer_ms": 2.0, "other_ms": 0.3}
    if mesh is not None:
        entry["mesh"] = mesh
    return entry


def _pp_dp(rank: int, **kw: Any) -> dict[str, Any]:
    """pp=2 x dp_shard=2 as distributed/mesh.py lays it out: rank = stage * 2 + dp."""
    return _rank(rank, mesh={"pp": [rank // 2, 2], "dp_shard": [rank % 2, 2]}, **kw)


def test_place_label_and_stage_read_the_mesh_place():
    entry = _rank(3, mesh={"pp": [1, 2], "dp_shard": [1, 2], "tp": [0, 2]})
    assert place_label(entry) == "stage 2 of 2, dp 2 of 2, tp 1 of 2"
    assert stage_of(entry) == (1, 2)
    assert place_label(_rank(0)) == "" and stage_of(_rank(0)) is None
    assert stage_of(_rank(0, mesh={"tp": [1, 2]})) is None


def test_pp_alone_names_nobody_where_the_plain_rule_names_the_last_stage():
    # the last stage computes 3x (the head and the loss, its place in the schedule)
    plain = [_rank(0, comm=20.0), _rank(1, compute=30.0)]
    assert find_straggler(plain) is not None            # what comparing across stages says
    staged = [_rank(0, comm=20.0, mesh={"pp": [0, 2]}), _rank(1, compute=30.0, mesh={"pp": [1, 2]})]
    assert find_straggler(staged) is None
    assert "each pipeline stage runs on one rank" in no_verdict(staged)
    assert no_verdict(plain[:1]) == "no straggler: the ranks keep pace"


def test_pp_x_dp_expected_stage_imbalance_names_nobody():
    # stage 2 computes twice stage 1 on both replicas: the pipeline's shape, not a straggler
    ranks = [_pp_dp(0, compute=10.0), _pp_dp(1, compute=10.5), _pp_dp(2, compute=20.0),
             _pp_dp(3, compute=21.0)]
    assert find_straggler([{k: v for k, v in r.items() if k != "mesh"} for r in ranks]) is not None
    assert find_straggler(ranks) is None
    assert no_verdict(ranks) == "no straggler: the ranks of each pipeline stage keep pace"
    assert no_verdict(ranks, ended=True) == "no straggler: the ranks of each pipeline stage kept pace"


def test_pp_x_dp_slow_rank_is_named_against_its_stage_with_its_place_and_pipeline():
    # rank 3 (stage 2, dp 2) computes 3x its stage's other rank; its pipeline partner rank 1
    # waits for it inside the schedule (counted as compute), less than rank 3's excess
    ranks = [_pp_dp(0, compute=10.0, comm=5.0), _pp_dp(1, compute=18.0), _pp_dp(2, compute=20.0, comm=40.0),
             _pp_dp(3, compute=60.0)]
    v = find_straggler(ranks)
    assert v is not None
    assert (v["rank"], v["cause"], v["factor"], v["stage"]) == (3, "compute", 3.0, 2)
    assert v["pipeline"] == [1, 3]
    assert v["message"].startswith(
        "rank 3 (stage 2 of 2, dp 2 of 2, host job-3, cuda:0) is the straggler: it computes 3.0x "
        "longer per step than the median rank of its stage")
    assert "rank 1 (stage 1 of 2, dp 2 of 2) stands out in its own stage too" in v["message"]


def test_tp_ranks_without_pp_are_compared_as_one_group():
    ranks = [_rank(r, mesh={"dp_shard": [r // 2, 2], "tp": [r % 2, 2]}, comm=19.0) for r in range(3)]
    ranks.append(_rank(3, compute=28.0, mesh={"dp_shard": [1, 2], "tp": [1, 2]}))
    v = find_straggler(ranks)
    assert v is not None and v["rank"] == 3 and "stage" not in v
    assert v["message"].startswith("rank 3 (dp 2 of 2, tp 2 of 2, host job-3, cuda:0)")
    assert "median rank;" in v["message"]


def test_the_live_window_rule_keeps_its_streak_under_pp():
    watch = StragglerWatch()
    ranks = [_pp_dp(0), _pp_dp(1), _pp_dp(2, compute=20.0), _pp_dp(3, compute=60.0)]
    assert [watch.window(ranks) is not None for _ in range(3)] == [False, False, True]
    assert watch.verdict is not None and watch.verdict["rank"] == 3


class _Mesh:
    """The part of a DeviceMesh `mesh_place` reads: this rank is (pp 1, dp_shard 0, tp 1)."""

    mesh_dim_names = ("pp", "dp_replicate", "dp_shard", "tp")
    _shape, _local = (2, 1, 2, 2), (1, 0, 0, 1)

    def size(self, dim: int) -> int:
        return self._shape[dim]

    def get_local_rank(self, name: str) -> int:
        return self._local[self.mesh_dim_names.index(name)]


def test_mesh_place_keeps_the_dimensions_larger_than_one():
    assert mesh_place(_Mesh()) == {"pp": [1, 2], "dp_shard": [0, 2], "tp": [1, 2]}


def test_top_shows_each_ranks_place_and_why_nobody_is_named(tmp_path: Path):
    ranks = [{**_rank(r, mesh={"pp": [r, 2]}), "step": 5, "loss": 1.0, "samples_per_s": 10.0}
             for r in range(2)]
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(frame(LiveRun(ranks), tmp_path))
    text = " ".join(console.export_text().split())
    assert "place" in text and "stage 1 of 2" in text and "stage 2 of 2" in text
    assert "each pipeline stage runs on one rank" in text
    plain = [{**_rank(r), "step": 5, "loss": 1.0, "samples_per_s": 10.0} for r in range(2)]
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(frame(LiveRun(plain), tmp_path))
    assert "place" not in console.export_text()   # no mesh: the table as before
