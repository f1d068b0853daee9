"""Neither the log doctor nor the linter may crash on arbitrary input."""

from __future__ import annotations

import ast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disttrain.diagnose.lint import lint_source
from disttrain.diagnose.logs import CAUSES, diagnose
from disttrain.errors import LintError

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Pieces of real log lines, so generated logs reach the parsers' interesting paths.
LOG_PIECES = [
    "[rank1]: ", "[default0]:", "[pod/job-0-x/trainer] ", "[rank 1 job-1] ",
    "2026-03-12T09:14:33.123Z ", "Traceback (most recent call last):\n",
    '  File "/w/train.py", line 7, in main\n', "ValueError: bad\n", "KeyError: 'x'\n",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n",
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE\n",
    "Connection closed by peer [127.0.0.1]:1\n", "Root Cause (first observed failure):\n",
    "[0]:\n", "  rank      : 1 (local_rank: 1)\n", "  exitcode  : -9 (pid: 12)  (SIGKILL)\n",
    "  host      : node\n", "  traceback : Traceback (most recent call last):\n",
    "=====\n", "Failures:\n", "-- Process 1 terminated with the following error:\n",
    "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE\n",
    "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1000\n",
    "Device 0 OOM 99 / 98\n", "Parameter indices which did not receive grad for rank 1: 2\n",
    "Expected to have finished reduction in the prior iteration\n", "\r", "\x1b[31m", "\n",
]


@SETTINGS
@given(st.text(max_size=3000))
def test_diagnose_never_raises_on_text(text: str) -> None:
    d = diagnose(text)
    assert d.cause in CAUSES and isinstance(d.evidence, list)
    assert "could not be analysed" not in d.title


@SETTINGS
@given(st.lists(st.one_of(st.sampled_from(LOG_PIECES), st.text(max_size=40)), max_size=60))
def test_diagnose_never_raises_on_log_like_text(pieces: list[str]) -> None:
    d = diagnose("".join(pieces))
    assert d.cause in CAUSES
    assert "could not be analysed" not in d.title
    assert d.to_dict()["cause"] == d.cause


@SETTINGS
@given(st.text(max_size=2000))
def test_lint_never_raises_on_arbitrary_text(source: str) -> None:
    try:
        findings = lint_source(source, "fuzz.py")
    except LintError as exc:
        assert str(exc).startswith("fuzz.py")
    else:
        assert all(f.path == "fuzz.py" and f.line >= 1 for f in findings)


# Statements that exercise the rules; any sequence of them, at any nesting, is valid Python.
STATEMENTS = [
    "import torch", "import torch.distributed as dist", "import os",
    "from torch.nn.parallel import DistributedDataParallel as DDP",
    "import torch.multiprocessing as mp", "from torch.utils.data import DataLoader",
    'dist.init_process_group("nccl", rank=rank, world_size=n)', "dist.destroy_process_group()",
    "rank = dist.get_rank()", 'local_rank = int(os.environ["LOCAL_RANK"])',
    "model = DDP(model, device_ids=[rank])", "torch.cuda.set_device(local_rank)",
    'torch.save(model.state_dict(), "m.pt")', 'sd = torch.load("m.pt")', "print(rank)",
    "opt = torch.optim.SGD(p, lr=0.1)", "loader = DataLoader(ds, shuffle=True)",
    "sampler = DistributedSampler(ds, rank=local_rank)", "sampler.set_epoch(e)",
    'os.environ["MASTER_PORT"] = "1"', "dist.barrier()", "mp.spawn(train, nprocs=2)",
    "x = train(rank, n)", "return rank", "pass", 'datasets.MNIST("/d", download=True)',
    "from torch.cuda.amp import autocast", "model = nn.DataParallel(model)",
]
HEADERS = ["if rank == 0:", "if rank != 0:", "for e in range(3):", "for b in loader:",
           "def train(rank, n):", "def setup():", "while True:", "try:", "with ctx:"]


@st.composite
def programs(draw: st.DrawFn) -> str:
    lines: list[str] = []
    depth = 0
    for _ in range(draw(st.integers(0, 40))):
        if draw(st.booleans()) and depth < 6:
            header = draw(st.sampled_from(HEADERS))
            lines.append("    " * depth + header)
            depth += 1
            lines.append("    " * depth + draw(st.sampled_from(STATEMENTS)))
            if header == "try:":
                lines.append("    " * (depth - 1) + "finally:")
                lines.append("    " * depth + "pass")
        else:
            lines.append("    " * depth + draw(st.sampled_from(STATEMENTS)))
        if depth and draw(st.booleans()):
            depth = draw(st.integers(0, depth))
    return "\n".join(lines) + "\n"


@SETTINGS
@given(programs())
def test_lint_never_raises_on_valid_programs(source: str) -> None:
    try:
        ast.parse(source)
    except SyntaxError:   # `return` outside a function, etc.: LintError is the answer
        return
    for f in lint_source(source, "gen.py"):
        assert f.rule.startswith("DT") and f.message and f.fix
