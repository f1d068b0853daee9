"""`diagnose()` on real logs: the root cause, its rank and host, and what followed from it.

The expectations live in logs/README.md next to each file's origin, so the table a person
reads is the table the test checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.diagnose.log_rules import SIGNATURES, UNFILTERED, leading_literals
from disttrain.diagnose.logs import CAUSES, Diagnosis, diagnose, format_diagnosis

LOGS = Path(__file__).parent / "logs"


def _table() -> list[tuple[str, str, int | None, str | None, list[str]]]:
    rows = []
    for line in (LOGS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or not cells[0].endswith(".log"):
            continue
        name, cause, rank, host, cons = cells[:5]
        rows.append((name, cause, None if rank == "-" else int(rank),
                     None if host == "-" else host,
                     [] if cons == "-" else [c.strip() for c in cons.split(",")]))
    return rows


TABLE = _table()


def test_every_fixture_is_in_the_table() -> None:
    assert sorted(r[0] for r in TABLE) == sorted(p.name for p in LOGS.glob("*.log"))


def test_every_cause_has_a_fixture() -> None:
    assert {r[1] for r in TABLE} == set(CAUSES)


@pytest.mark.parametrize(("name", "cause", "rank", "host", "consequences"), TABLE,
                         ids=[r[0] for r in TABLE])
def test_fixture(name: str, cause: str, rank: int | None, host: str | None,
                 consequences: list[str]) -> None:
    d = diagnose((LOGS / name).read_text())
    assert (d.cause, d.rank, d.host) == (cause, rank, host), format_diagnosis(d)
    assert d.consequences == consequences
    assert d.title and d.fix
    if cause != "none":
        assert d.evidence, "a conclusion must show the lines it rests on"
    assert "could not be analysed" not in d.title


def test_root_cause_wins_whatever_the_order() -> None:
    """The watchdog line printed first (interleaving) still loses to the OOM."""
    text = (
        "[rank0]:[E1218 20:27:21.4 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.\n"
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/workspace/train.py", line 10, in <module>\n'
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
        "GPU 1 has a total capacity of 11.72 GiB of which 1.06 GiB is free.\n")
    d = diagnose(text)
    assert (d.cause, d.rank) == ("cuda_oom", 1)
    assert d.consequences == ["collective_timeout"]
    assert "2.00 GiB" in d.title


def test_user_error_beats_peer_errors_printed_before_it() -> None:
    text = (
        "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:30609\n"
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "/workspace/train.py", line 7, in load\n'
        "[rank1]:     x = table[key]\n"
        "[rank1]: KeyError: 'img_0001'\n")
    d = diagnose(text)
    assert (d.cause, d.rank) == ("user_code_error", 1)
    assert "KeyError" in d.title and "/workspace/train.py:7 in load" in d.fix
    assert d.consequences == ["nccl_network_error"]


def test_first_failure_rank_breaks_ties_between_user_errors() -> None:
    """Two ranks raise; torchrun's Root Cause record says which failed first."""
    tb = ('[rank{r}]: Traceback (most recent call last):\n[rank{r}]:   File "t.py", line 3, '
          'in f\n[rank{r}]: ValueError: bad value on {r}\n')
    summary = ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-01-01_00:00:00\n"
               "  host      : node-b\n  rank      : 1 (local_rank: 0)\n  exitcode  : 1 (pid: 9)\n"
               "  error_file: <N/A>\n  traceback : To enable traceback see: x\n" + "=" * 20)
    d = diagnose(tb.format(r=0) + tb.format(r=1) + summary)
    assert (d.cause, d.rank, d.host) == ("user_code_error", 1, "node-b")


def test_kubectl_timestamps_and_pod_prefixes() -> None:
    text = ("[pod/job-1-abc/trainer] 2026-03-12T09:14:33.123456789Z [rank3]: "
            "torch.OutOfMemoryError: CUDA out of memory.\n")
    d = diagnose(text)
    assert (d.cause, d.rank, d.host) == ("cuda_oom", 3, "job-1-abc")


def test_disttrain_k8s_logs_prefix() -> None:
    """`disttrain k8s logs` prefixes `[rank <node rank> <pod>]`: the pod is the host."""
    text = "[rank 1 mnist-ddp-1] [rank3]: RuntimeError: No CUDA GPUs are available\n"
    d = diagnose(text)
    assert (d.cause, d.rank, d.host) == ("no_gpu_visible", 3, "mnist-ddp-1")


def test_nccl_harmless_bind_warning_is_not_port_in_use() -> None:
    text = ("node:12:40 [0] misc/socket.cc:484 NCCL WARN Call to bind failed: Address already "
            "in use\nepoch 0 loss 2.30\nepoch 1 loss 1.10\n")
    assert diagnose(text).cause == "none"


def test_download_dns_error_is_not_a_rendezvous_failure() -> None:
    text = ("Traceback (most recent call last):\n  File \"train.py\", line 30, in <module>\n"
            "urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name "
            "resolution>\n")
    d = diagnose(text)
    assert d.cause == "user_code_error" and "URLError" in d.title


def test_seed_guide_messages() -> None:
    """The one-line errors quoted in seed 000 §8 map to their causes."""
    cases = {
        "RuntimeError: NCCL error: unhandled system error": "nccl_network_error",
        "RuntimeError: No CUDA GPUs are available": "no_gpu_visible",
        "RuntimeError: Address already in use": "port_in_use",
        "RuntimeError: Expected to have finished reduction from the prior iteration before "
        "starting a new one": "unused_parameters",   # the guide's words; torch says "in the"
        "RuntimeError: Expected to have finished reduction in the prior iteration before "
        "starting a new one.": "unused_parameters",
        "CUDA out of memory": "cuda_oom",
    }
    for text, cause in cases.items():
        assert diagnose(text).cause == cause, text


@pytest.mark.parametrize("text", ["", "\n\n", "hello world\n"])
def test_unknown_without_training_output(text: str) -> None:
    d = diagnose(text)
    assert d.cause == "unknown" and d.rank is None


def test_bytes_and_odd_input_never_raise() -> None:
    assert diagnose(b"RuntimeError: No CUDA GPUs are available\xff").cause == "no_gpu_visible"
    assert diagnose("\x00\r\r\n" * 50 + "x" * 100_000).cause == "unknown"


def test_to_dict_shape_and_json() -> None:
    d = diagnose((LOGS / "cuda_oom_then_watchdog.log").read_text())
    data = json.loads(json.dumps(d.to_dict()))
    assert list(data) == ["cause", "title", "rank", "host", "evidence", "fix", "consequences",
                          "confidence", "confidence_evidence", "alternative"]
    assert isinstance(data["evidence"], list) and isinstance(data["consequences"], list)
    assert d.failed and not diagnose("epoch 1 loss 0.3").failed


def test_diagnosis_is_frozen() -> None:
    d = Diagnosis("none", "t")
    with pytest.raises(AttributeError):
        d.cause = "x"  # type: ignore[misc]


def test_format_names_cause_rank_evidence_fix() -> None:
    text = format_diagnosis(diagnose((LOGS / "user_code_error_gloo.log").read_text()))
    assert text.startswith("cause: user_code_error")
    assert "where: rank 1, host localhost" in text
    assert "  | [rank1]: ValueError" in text and "fix: " in text
    assert "consequences, not the cause): nccl_network_error" in text


def test_every_signature_has_a_literal_prefilter() -> None:
    """The fast path looks only at lines holding a signature's literal start."""
    assert UNFILTERED == ()
    for sig in SIGNATURES:
        assert leading_literals(sig.pattern.pattern), sig.pattern.pattern


def test_big_log_stays_linear() -> None:
    """A long clean log plus one failure: the failure is found (no quadratic scans)."""
    noise = "[default0]:epoch 0 step 1 loss 0.0507\n" * 20_000
    d = diagnose(noise + "[rank1]: RuntimeError: CUDA error: invalid device ordinal\n" + noise)
    assert (d.cause, d.rank) == ("no_gpu_visible", 1)


def test_watchdog_stall_line_names_the_stalled_rank():
    from disttrain.diagnose.logs import diagnose

    text = "\n".join([
        "[rank0]:[E1130 gloo] Timed out waiting 30000ms for recv operation to complete",
        "error: rank 1 (pid 4242, host node-a) made no progress for 6 s; last seen: step 17, "
        "phase backward",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ])
    d = diagnose(text)
    assert d.cause == "collective_timeout" and d.rank == 1
    assert "step 17, phase backward" in d.title


# -- precedence, confidence and advice that fits the job ----------------------------------
def test_framework_error_with_a_traceback_beats_user_code_error() -> None:
    """A shared-memory failure raised through the user's loop is not the user's bug."""
    text = ("[rank0]: Traceback (most recent call last):\n"
            '[rank0]:   File "/w/train.py", line 9, in <module>\n'
            "[rank0]:     for x in loader:\n"
            "[rank0]: RuntimeError: unable to allocate shared memory(shm) for file "
            "</torch_1_2_0>: No space left on device (28)\n")
    d = diagnose(text)
    assert (d.cause, d.rank, d.confidence) == ("shm_too_small", 0, "high")


def test_abort_after_the_ranks_exception_is_a_consequence() -> None:
    d = diagnose((LOGS / "user_code_error_then_abort.log").read_text())
    assert (d.cause, d.rank) == ("user_code_error", 1) and "labels out of range" in d.title
    assert "cpp_abort" in d.consequences
    assert "_dynamo" not in d.fix and "gdb" not in d.fix


@pytest.mark.parametrize(("exc_prefix", "abort_prefix"), [
    ("", ""),                              # mp.spawn / plain python
    ("[rank1]: ", ""),                     # torchrun: torch's exception prefix only
    ("[rank1]: ", "[rank1]:"),             # the abort through a line-prefixing launcher
    ("[rank1]:[rank1]: ", "[rank1]:"),     # disttrain run: both prefixes on Python's lines
    ("[rank1]:[rank1]: ", "[rank1]:[rank1]: "),
    ("[default1]:[rank1]: ", "[default1]:"),   # torchrun --tee
])
def test_exception_then_own_abort_names_the_exception(exc_prefix: str,
                                                      abort_prefix: str) -> None:
    """Issue 25 item 5b: the rank's RuntimeError is the cause, its teardown abort after it
    a consequence, whatever prefixes the lines carry (libstdc++'s and CPython's messages)."""
    lines = ["Traceback (most recent call last):",
             '  File "/w/train.py", line 14, in <module>',
             '    raise RuntimeError("shape mismatch in my_loss: expected 4, got 3")',
             "RuntimeError: shape mismatch in my_loss: expected 4, got 3"]
    abort = "".join(f"{abort_prefix}{line}\n" for line in (
        "terminate called without an active exception", "Fatal Python error: Aborted", "",
        "Thread 0x00007f3a2c9fe640 (most recent call first):", "  <no Python frame>"))
    d = diagnose("".join(f"{exc_prefix}{line}\n" for line in lines) + abort)
    assert d.cause == "user_code_error" and "shape mismatch in my_loss" in d.title
    assert d.consequences == ["cpp_abort"] and "/w/train.py:14" in d.fix
    assert "_dynamo" not in d.fix and "gdb" not in d.fix
    assert diagnose(abort).cause == "cpp_abort"   # alone: a finished run's teardown


def test_checkpoint_of_another_model_names_the_keys() -> None:
    """Issue 25 item 5: torch's load_state_dict error and disttrain's resume check."""
    d = diagnose((LOGS / "checkpoint_mismatch_torch.log").read_text())
    assert d.cause == "checkpoint_mismatch" and "checkpoint [10, 16], model [10, 32]" in d.title
    assert "another run dir" in d.fix and "without --resume" in d.fix
    d = diagnose((LOGS / "checkpoint_mismatch_resume.log").read_text())
    assert d.cause == "checkpoint_mismatch" and "fc1.weight: checkpoint [16, 64]" in d.title


def test_cpu_build_fix_says_what_to_change_in_the_script() -> None:
    for name in ("version_mismatch_cpu_build.log", "version_mismatch_set_device_cpu.log"):
        d = diagnose((LOGS / name).read_text())
        assert '"nccl" if torch.cuda.is_available() else "gloo"' in d.fix, name
        assert "`--backend gloo`)" not in d.fix


@pytest.mark.parametrize(("name", "needle", "absent"), [
    ("port_in_use_torchrun.log", "torchrun --master-port", "export MASTER_PORT=29501` /"),
    ("port_in_use_windows.log", "torchrun --master-port", None),
])
def test_port_in_use_fix_fits_the_launcher(name: str, needle: str, absent: str | None) -> None:
    d = diagnose((LOGS / name).read_text())
    assert d.cause == "port_in_use" and needle in d.fix
    assert "no effect" in d.fix   # an exported MASTER_PORT does not reach torchrun's workers
    if absent:
        assert absent not in d.fix


def test_port_in_use_fix_when_the_script_sets_the_port() -> None:
    text = ('  File "/w/train.py", line 4, in <module>\n'
            '    os.environ["MASTER_PORT"] = "29500"\n'
            "RuntimeError: Address already in use\n")
    d = diagnose("Traceback (most recent call last):\n" + text)
    assert d.cause == "port_in_use" and "change or remove that line" in d.fix


def test_disttrain_run_port_fix() -> None:
    text = ("error: the job failed (failed rank(s): 0)\n"
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
            "local network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE\n")
    assert "disttrain run --master-port 0" in diagnose(text).fix


def test_sys_exit_is_a_deliberate_exit_not_unknown() -> None:
    d = diagnose((LOGS / "user_code_error_sys_exit.log").read_text())
    assert (d.cause, d.rank) == ("user_code_error", 1)
    assert "exited with code 3" in d.title and "NCCL" not in d.fix


def test_gloo_peer_lost_is_not_called_nccl() -> None:
    text = ("[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] "
            "Connection closed by peer [10.0.0.2]:4242\n")
    d = diagnose(text)
    assert d.cause == "nccl_network_error" and "NCCL" not in d.title
    assert "GLOO_SOCKET_IFNAME" in d.fix and d.confidence == "low" and d.alternative


def test_doctor_skips_its_own_earlier_diagnosis() -> None:
    """`disttrain run ... 2>&1 | tee job.log` ends with a diagnosis: it is not re-read."""
    log = (LOGS / "user_code_error_gloo.log").read_text()
    first = diagnose(log)
    echoed = log + "error: the job failed (failed rank(s): 1)\n" + format_diagnosis(first) + "\n"
    again = diagnose(echoed)
    assert (again.cause, again.rank, again.evidence) == (first.cause, first.rank, first.evidence)


def test_logs_folder_reads_every_rank(tmp_path: Path) -> None:
    from disttrain.diagnose.log_sources import read_log_dir

    for rank, text in (("0", "step 0 ok\n"),
                       ("1", "Traceback (most recent call last):\n"
                             '  File "/w/train.py", line 3, in <module>\n'
                             "KeyError: 'x'\n")):
        folder = tmp_path / "logs" / "run1" / "attempt_0" / rank
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(text)
        (folder / "stdout.log").write_text("")
    d = diagnose(read_log_dir(tmp_path / "logs") or "")
    assert (d.cause, d.rank) == ("user_code_error", 1)
    assert read_log_dir(tmp_path / "empty-does-not-exist") is None


def test_confidence_levels() -> None:
    assert diagnose("RuntimeError: CUDA out of memory.").confidence == "high"
    low = diagnose("RuntimeError: NCCL error: unhandled system error")
    assert (low.confidence, low.alternative) == ("low", "shm_too_small")
    assert diagnose("epoch 1 loss 0.3").confidence == "high"
    assert diagnose("").confidence == "low"


def test_wrapped_message_is_read_across_the_break() -> None:
    """A terminal cut `CUDA out of memory` in two; the second half lost the prefix."""
    assert diagnose("[rank2]: RuntimeError: CUDA out of mem\n").cause != "cuda_oom"
    wrapped = ("[rank2]: RuntimeError: CUDA error while running the step: CUDA out of mem\n"
               "ory. Tried to allocate 2.00 GiB.\n")
    d = diagnose(wrapped)
    assert (d.cause, d.rank, d.confidence) == ("cuda_oom", 2, "medium")
    assert "2.00 GiB" in d.title


def test_doctor_logs_cli_reads_a_run_logs_folder(tmp_path: Path) -> None:
    """`disttrain doctor logs runs/NAME/logs`: every rank's files, the failing rank named."""
    from click.testing import CliRunner

    from disttrain.cli.main import cli

    folder = tmp_path / "logs" / "r" / "attempt_0" / "1"
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text("RuntimeError: No CUDA GPUs are available\n")
    r = CliRunner().invoke(cli, ["doctor", "logs", "--json", str(tmp_path / "logs")])
    data = json.loads(r.stdout)
    assert r.exit_code == 1 and (data["cause"], data["rank"]) == ("no_gpu_visible", 1)


def test_failed_ranks_leave_out_the_ranks_torchrun_stopped() -> None:
    from disttrain.cli.run_cmd import _failed_ranks
    from disttrain.launch.result import RankFailure

    failures = {0: RankFailure(exitcode=-15), 1: RankFailure(exitcode=3), 2: RankFailure(exitcode=-15)}
    assert _failed_ranks(failures) == [1]
    assert _failed_ranks({0: RankFailure(exitcode=-15)}) == [0]   # only stopped ranks: say them
