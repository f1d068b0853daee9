"""The launch plan and the launchers' one result type, without starting a process group:
LaunchConfig fields from a spec, threads per rank, port choice, failure records, the
in-process `env` launcher, and the socket probes."""

from __future__ import annotations

import os
import socket
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from disttrain.distributed.process import threads_per_rank
from disttrain.errors import FailureKind, LaunchError, PortTaken
from disttrain.launch import launchers, plan
from disttrain.launch.plan import LaunchPlan, launch_config, make_plan, start_error, worker_env
from disttrain.launch.ports import free_port, listening, port_free
from disttrain.launch.result import LaunchResult, RankFailure
from disttrain.resilience.watchdog import Stall
from disttrain.spec.job import JobSpec, LaunchSpec


def _spec(**overrides) -> JobSpec:
    return JobSpec.from_dict({}, overrides)


# -- LaunchConfig ------------------------------------------------------------------------------
def test_one_node_is_a_static_rendezvous_at_the_master(tmp_path: Path):
    spec = _spec(master_port=29601, timeout_s=42.9, max_restarts=2, name="job")
    config = LaunchPlan(spec, 3).config("forkserver", scratch_dir=tmp_path)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 3)
    assert config.rdzv_backend == "static" and config.rdzv_endpoint == "127.0.0.1:29601"
    assert config.rdzv_configs == {"rank": 0, "timeout": 42}
    assert config.max_restarts == 2 and config.start_method == "forkserver"
    assert config.monitor_interval == plan.MONITOR_INTERVAL_S
    assert config.run_id.startswith("job-") and len(config.run_id) == len("job-") + 8
    assert config.log_line_prefix_template is None  # nothing tee'd
    assert config.logs_specs.root_log_dir == str(tmp_path)   # the agent's files: the scratch


def test_a_config_without_a_folder_for_the_agents_files_is_refused():
    """torch's default logs spec would make a torchelastic_* folder in /tmp right away."""
    with pytest.raises(ValueError, match="logs_dir or scratch_dir"):
        launch_config(LaunchSpec(), 2, name="x", start_method="spawn")


def test_several_nodes_rendezvous_with_c10d_at_the_endpoint(tmp_path: Path):
    spec = _spec(nnodes=2, master_addr="10.0.0.1", master_port=29500, rdzv_id="r1")
    config = LaunchPlan(spec, 2).config("spawn", scratch_dir=tmp_path)
    assert (config.min_nodes, config.max_nodes) == (2, 2) and config.rdzv_backend == "c10d"
    assert config.rdzv_endpoint == "10.0.0.1:29500" and config.run_id == "r1"
    assert config.rdzv_configs == {"timeout": 300, "join_timeout": 180}  # rdzv_timeout_s
    spec = _spec(nnodes=2, rdzv_endpoint="head:1234")
    assert LaunchPlan(spec, 2).config("spawn", scratch_dir=tmp_path).rdzv_endpoint == "head:1234"


def test_script_logs_are_teed_with_rank_prefixes(tmp_path: Path):
    config = launch_config(LaunchSpec(), 2, name="x", start_method="spawn", logs_dir=tmp_path)
    assert config.log_line_prefix_template == "[rank${rank}]:"
    assert config.logs_specs.root_log_dir == str(tmp_path)


def test_run_ranks_config_is_the_same_builder(tmp_path: Path):
    """`disttrain.testing.run_ranks` builds through `launch_config` from a bare LaunchSpec."""
    config = launch_config(LaunchSpec(master_port=4321, timeout_s=120, max_restarts=1), 2,
                           name="test", start_method="forkserver", scratch_dir=tmp_path)
    assert config.rdzv_endpoint == "127.0.0.1:4321" and config.rdzv_backend == "static"
    assert config.rdzv_configs == {"rank": 0, "timeout": 120} and config.max_restarts == 1
    assert config.run_id.startswith("test-")


# -- the workers' environment ------------------------------------------------------------------
@pytest.mark.parametrize(("cores", "nproc", "want"), [(8, 2, "4"), (8, 3, "2"), (2, 4, "1")])
def test_worker_threads_share_the_cores_as_the_ranks_do(monkeypatch, cores, nproc, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    env = worker_env(_spec(), nproc)
    assert env["OMP_NUM_THREADS"] == want == str(threads_per_rank(nproc))


def test_worker_threads_from_the_spec_and_the_clock_kept(monkeypatch):
    monkeypatch.setenv("DISTTRAIN_T0", "123.5")
    env = worker_env(_spec(threads=3), 2)
    assert env == {"OMP_NUM_THREADS": "3", "DISTTRAIN_T0": "123.5"}


def test_worker_clock_is_this_process_start(monkeypatch):
    monkeypatch.delenv("DISTTRAIN_T0", raising=False)
    assert float(worker_env(_spec(), 2)["DISTTRAIN_T0"]) > 0


# -- the master port ---------------------------------------------------------------------------
def _held_port():
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


def test_port_zero_picks_a_free_one_and_a_remote_port_is_kept():
    port, note = plan.choose_port(_spec(master_port=0))
    assert port > 0 and note is None
    assert plan.choose_port(_spec(master_addr="10.0.0.1", master_port=1234)) == (1234, None)


def test_a_taken_port_moves_unless_asked_for():
    held, port = _held_port()
    with held:
        spec = _spec(master_port=port)
        moved, note = plan.choose_port(spec)
        assert moved != port and note == f"port {port} is in use; using free port {moved} instead"
        spec.launch.port_explicit = True
        with pytest.raises(LaunchError, match=f"master port {port} is already in use"):
            plan.choose_port(spec)


def test_make_plan_and_moved_to():
    held, port = _held_port()
    with held:
        p = make_plan(_spec(master_port=port, nproc_per_node=2))
        assert p.nproc == 2 and p.spec.launch.master_port != port and len(p.notes) == 1
        kept = make_plan(_spec(master_port=port), pick_port=False)
        assert kept.spec.launch.master_port == port and kept.notes == []
    again = p.moved_to(1234, "taken")
    assert again.spec.launch.master_port == 1234 and again.notes == [*p.notes, "taken"]
    assert p.spec.launch.master_port != 1234, "a plan is not changed in place"


# -- one result type ---------------------------------------------------------------------------
def _process_failure(message, exitcode=1):
    return SimpleNamespace(message=message, exitcode=exitcode, pid=77, local_rank=1,
                           error_file="/tmp/err.json")


def test_failure_from_torch_and_its_summary():
    failure = RankFailure.from_elastic(_process_failure("Traceback ...\nValueError: boom"), "h")
    assert (failure.exitcode, failure.pid, failure.local_rank, failure.host) == (1, 77, 1, "h")
    assert failure.summary() == "rank crashed (exit code 1): ValueError: boom"
    as_dict = RankFailure.from_elastic(_process_failure({"message": "RuntimeError: x"}))
    assert as_dict.message == "RuntimeError: x"
    placeholder = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    assert RankFailure.from_elastic(_process_failure(placeholder, -9)).summary() == \
        "rank crashed (exit code -9)"
    assert RankFailure(exitcode=3).summary() == "rank crashed (exit code 3)"


def test_stalls_lead_the_log_and_name_killed_ranks():
    stall = Stall(rank=1, pid=11, host="h", step=4, phase="backward", stale_s=30.0, frozen=True,
                  tied=((2, 12),))
    result = LaunchResult.failed({0: RankFailure("waiting", exitcode=1)}, log_text="log")
    launchers._add_stalls(result, [stall])
    assert result.stalls == [stall.message]
    assert result.log_text == f"error: {stall.message}\nlog"
    assert sorted(result.failures) == [0, 1, 2] and result.failures[0].message == "waiting"
    assert result.failures[2] == RankFailure(stall.message, exitcode=-9, host="h", pid=12,
                                             kind=FailureKind.STALL)
    assert result.failures[0].kind == FailureKind.CRASH   # waiting for it: not the stall
    ok = LaunchResult()
    launchers._add_stalls(ok, [stall])
    assert ok.failures == {} and ok.stalls == [stall.message]


def test_every_launcher_choice_has_a_launcher():
    choices = typing.get_args(LaunchSpec.model_fields["launcher"].annotation)
    assert set(launchers.LAUNCHERS) == set(choices)


def test_start_errors_name_the_port_or_the_rendezvous():
    p = LaunchPlan(_spec(master_port=29611), 2)
    assert isinstance(start_error(p, RuntimeError("EADDRINUSE")), PortTaken)
    err = start_error(LaunchPlan(_spec(nnodes=2, rdzv_endpoint="head:9"), 2),
                      RuntimeError("timed out\nmore"))
    assert not isinstance(err, PortTaken)
    assert str(err).startswith("cannot rendezvous at head:9 (RuntimeError: timed out); check")


@pytest.mark.parametrize(("body", "code", "message"), [
    ("import sys; sys.exit(3)", 3, ""),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("print('fine')", 0, None),
])
def test_env_launcher_reports_this_rank(tmp_path, monkeypatch, capsys, body, code, message):
    script = tmp_path / "s.py"
    script.write_text(body + "\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("RANK", "1")
    spec = _spec(script=str(script), launcher="env")
    result = launchers.EnvLauncher().launch(LaunchPlan(spec, 1))
    assert result.exit_code == code
    if message is None:
        assert result.failures == {}
    else:
        assert list(result.failures) == [1] and result.failures[1].message == message
    if code == 1:
        assert "Traceback" in capsys.readouterr().err and "ValueError" in result.log_text


# -- socket probes -----------------------------------------------------------------------------
def test_probes_see_a_listener():
    held, port = _held_port()
    with held:
        assert listening("127.0.0.1", port) and not port_free(port)
    assert not listening("127.0.0.1", free_port())
