"""Each lint rule fires on its mistake, stays silent on the correct form, and obeys ignores."""

from __future__ import annotations

from pathlib import Path

import pytest

from disttrain.diagnose.lint import RULES, lint_paths, lint_source
from disttrain.errors import LintError

SCRIPTS = Path(__file__).parent / "scripts"
PRE = ("import os\nimport torch\nimport torch.distributed as dist\n"
       "from torch.nn.parallel import DistributedDataParallel as DDP\n"
       "from torch.utils.data import DataLoader, DistributedSampler\n"
       "from torchvision import datasets\n")
INIT = 'dist.init_process_group("gloo")\n'
END = "dist.destroy_process_group()\n"

# rule -> (sources where it must fire, sources where it must not)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "DT001": (["import torch.nn as nn\nmodel = nn.DataParallel(net)\n",
               "from torch.nn import DataParallel as DP\nm = DP(net, device_ids=[0, 1])\n"],
              ["import torch\nm = torch.nn.parallel.DistributedDataParallel(net)\n"
               "ok = isinstance(m, torch.nn.DataParallel)\n"]),
    "DT002": ([PRE + 'dist.init_process_group("nccl")\nx = torch.ones(3)\ndist.all_reduce(x)\n',
               PRE + 'dist.init_process_group(backend="gloo")\n'
                     'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n',
               PRE + 'if torch.cuda.is_available():\n    device = torch.device("cuda", 0)\n'
                     'else:\n    device = torch.device("cpu")\n'
                     'dist.init_process_group(backend="nccl")\nmodel = model.to(device)\n',
               PRE + "import argparse\np = argparse.ArgumentParser()\n"
                     'p.add_argument("--backend", default="nccl")\nargs = p.parse_args()\n'
                     'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
                     "dist.init_process_group(backend=args.backend)\nmodel = model.to(device)\n"],
              [PRE + 'dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")\n',
               PRE + 'dist.init_process_group("nccl")\nmodel = model.cuda()\n',
               PRE + 'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
                     'dist.init_process_group("nccl" if device == "cuda" else "gloo")\n',
               PRE + 'dist.init_process_group("gloo")\nx = torch.ones(2)\n',
               PRE + "import argparse\np = argparse.ArgumentParser()\n"
                     'p.add_argument("--backend", default="gloo")\nargs = p.parse_args()\n'
                     'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
                     "dist.init_process_group(backend=args.backend)\nmodel = model.to(device)\n"]),
    "DT003": ([PRE + "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\n"
                     "for epoch in range(3):\n    for x in loader:\n        step(x)\n",
               PRE + "def one_epoch(train_loader):\n    for i, x in enumerate(train_loader):\n"
                     "        step(x)\n\ndl = DataLoader(ds, sampler=DistributedSampler(ds))\n"
                     "for epoch in range(3):\n    one_epoch(dl)\n"],
              [PRE + "sampler = DistributedSampler(ds)\nloader = DataLoader(ds, sampler=sampler)\n"
                     "for epoch in range(3):\n    sampler.set_epoch(epoch)\n"
                     "    for x in loader:\n        step(x)\n",
               PRE + "loader = DataLoader(ds, sampler=DistributedSampler(ds))\n"
                     "for x in loader:\n    step(x)\n",
               PRE + "loader = DataLoader(ds, shuffle=True)\nfor e in range(2):\n"
                     "    for x in loader:\n        step(x)\n"]),
    "DT004": ([PRE + INIT + 'torch.save(model.state_dict(), "m.pt")\n',
               PRE + "class T:\n    def __init__(self):\n        print('Loading snapshot')\n"
                     "def main():\n    " + INIT + "    T()\n",
               PRE + INIT + 'def main():\n    print("epoch done")\n\nmain()\n',
               PRE + INIT + "import logging\nlog = logging.getLogger(__name__)\n"
                            'log.info("loss %s", 1.0)\n'],
              [PRE + INIT + 'if dist.get_rank() == 0:\n    torch.save(model.state_dict(), "m.pt")\n',
               PRE + INIT + "def save(model):\n    if dist.get_rank() != 0:\n        return\n"
                            '    torch.save(model.state_dict(), "m.pt")\n',
               PRE + INIT + "def report(loss):\n    print(loss)\n\nrank = dist.get_rank()\n"
                            "if rank == 0 and step % 10 == 0:\n    report(1.0)\n",
               PRE + INIT + 'rank = dist.get_rank()\nprint(f"rank {rank} ready")\n',
               PRE + INIT + "class T:\n    def log(self, w, x):\n        w.add_scalar('loss', x)\n"
                            "    def step(self):\n        if self.master_process:\n"
                            "            self.log(self.writer, 1.0)\n",
               PRE + INIT + 'if int(os.environ["RANK"]) == 0:\n    print("x")\n'
                            'if args.local_rank in [-1, 0]:\n    print("y")\n',
               'import torch\ntorch.save(m, "m.pt")\nprint("single process script")\n',
               PRE + INIT + 'def save_checkpoint(model):  # an API: callers decide the rank\n'
                            '    torch.save(model.state_dict(), "m.pt")\n',
               PRE + "import torch.multiprocessing as mp\ndef work(r):\n"
                     '    dist.init_process_group("gloo", rank=r, world_size=2)\n'
                     "def main():\n    mp.spawn(work, nprocs=2)\n    print('all done')\n\nmain()\n",
               PRE + "def main():\n    if not torch.cuda.is_available():\n"
                     "        print('Unable to locate GPUs. Exiting.')\n        return\n"
                     "    " + INIT + "    " + END + "\nmain()\n"]),
    "DT005": ([PRE + INIT + "model = DDP(net)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
               PRE + INIT + "model = DDP(net)\nLR = 1e-3\nfrom torch.optim import AdamW\n"
                            "opt = AdamW(model.parameters(), lr=LR)\n",
               PRE + INIT + "import argparse\np = argparse.ArgumentParser()\n"
                            'p.add_argument("--lr", type=float, default=0.01)\nargs = p.parse_args()\n'
                            "model = DDP(net)\nlr = args.lr\n"
                            "opt = torch.optim.SGD(model.parameters(), lr=lr)\n"],
              [PRE + INIT + "opt = torch.optim.SGD(model.parameters(), "
                            "lr=0.1 * dist.get_world_size())\n",
               PRE + INIT + "lr = 0.1\nlr *= dist.get_world_size()\n"
                            "opt = torch.optim.SGD(model.parameters(), lr=lr)\n",
               PRE + INIT + "opt = torch.optim.SGD(model.parameters(), lr=args.lr)\n",
               PRE + INIT + "import argparse\np = argparse.ArgumentParser()\n"
                            'p.add_argument("--lr", type=float, default=0.01)\nargs = p.parse_args()\n'
                            "args.lr *= dist.get_world_size()\nmodel = DDP(net)\n"
                            "opt = torch.optim.SGD(model.parameters(), lr=args.lr)\n",
               PRE + INIT + "opt = torch.optim.SGD(ps_model.parameters(), lr=0.1)  # no DDP\n",
               "import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"]),
    "DT006": ([PRE + INIT + 'if dist.get_rank() == 0:\n    torch.save(model.state_dict(), "c.pt")\n'
                            'state = torch.load("c.pt", weights_only=True)\n',
               PRE + INIT + 'if dist.get_rank() == 0:\n    datasets.MNIST("/data", download=True)\n'
                            'train = datasets.MNIST("/data", train=True)\n'],
              [PRE + INIT + 'if dist.get_rank() == 0:\n    torch.save(model.state_dict(), "c.pt")\n'
                            'dist.barrier()\nstate = torch.load("c.pt", weights_only=True)\n',
               PRE + INIT + 'if dist.get_rank() == 0:\n    torch.save(model.state_dict(), "c.pt")\n'
                            'state = torch.load("other.pt", weights_only=True)\n',
               PRE + INIT + 'state = torch.load("c.pt", weights_only=True)\n'
                            'if dist.get_rank() == 0:\n    torch.save(state, "c.pt")\n']),
    "DT007": ([PRE + INIT + "rank = dist.get_rank()\nmodel = DDP(model, device_ids=[rank])\n",
               PRE + INIT + "model = DDP(model, device_ids=[0])\n",
               PRE + INIT + 'torch.cuda.set_device(int(os.environ["RANK"]))\n',
               PRE + INIT + 'env = dict(os.environ)\nrank = int(env["RANK"])\n'
                            "torch.accelerator.set_device_index(rank)\n",
               PRE + INIT + "class T:\n    def __init__(self):\n"
                            '        self.rank = int(os.environ["RANK"])\n'
                            "        self.model = net.cuda(self.rank)\n"],
              [PRE + INIT + 'local_rank = int(os.environ["LOCAL_RANK"])\n'
                            "torch.cuda.set_device(local_rank)\n"
                            "model = DDP(model, device_ids=[local_rank])\n",
               PRE + INIT + "model = DDP(model, device_ids=[args.local_rank])\n",
               PRE + INIT + "rank = dist.get_rank()\n"
                            "model = DDP(model, device_ids=[rank % torch.cuda.device_count()])\n",
               PRE + 'local_rank = int(os.environ["LOCAL_RANK"])\nINIT\n'.replace("INIT\n", INIT)
                   + "torch.accelerator.set_device_index(local_rank)\nx = x.to(local_rank)\n",
               PRE + 'os.environ["MASTER_ADDR"] = "localhost"\n'
                     "def work(rank):\n"
                     '    dist.init_process_group("nccl", rank=rank, world_size=2)\n'
                     "    torch.cuda.set_device(rank)\n"]),
    "DT008": (["import torch.distributed.launch\n",
               "import argparse\np = argparse.ArgumentParser()\n"
               'p.add_argument("--local_rank", type=int, default=0)\n',
               'import subprocess\nsubprocess.run("python -m torch.distributed.launch '
               '--nproc_per_node=2 train.py", shell=True)\n'],
              ['"""Run with torchrun, not torch.distributed.launch."""\nimport torch\n',
               'import subprocess\nsubprocess.run(["torchrun", "--nproc-per-node", "2", "t.py"])\n']),
    "DT009": ([PRE + INIT + "train()\n"],
              [PRE + INIT + "try:\n    train()\nfinally:\n    " + END]),
    "DT010": ([PRE + INIT + 'ds = datasets.MNIST("/data", train=True, download=True)\n',
               PRE + INIT + "from urllib.request import urlretrieve\n"
                            'urlretrieve("https://example.org/d.tgz", "/data/d.tgz")\n'],
              [PRE + INIT + 'if dist.get_rank() == 0:\n    datasets.MNIST("/data", download=True)\n'
                            'dist.barrier()\nds = datasets.MNIST("/data", download=False)\n',
               'from torchvision import datasets\nds = datasets.MNIST("/d", download=True)\n']),
    "DT011": (["from torch.cuda.amp import autocast, GradScaler\n",
               "import torch\nscaler = torch.cuda.amp.GradScaler()\n",
               "from torch.cuda import amp\n"],
              ['import torch\nscaler = torch.amp.GradScaler("cuda")\n'
               'with torch.amp.autocast("cuda", dtype=torch.bfloat16):\n    pass\n']),
    "DT012": (['import torch\nsd = torch.load("m.pt")\n'],
              ['import torch\nsd = torch.load("m.pt", weights_only=True)\n']),
    "DT013": ([PRE + INIT + "model.cuda()\n"
                            'sd = torch.load("m.pt", weights_only=True)\n'],
              [PRE + INIT + "model.cuda()\n"
                            'sd = torch.load("m.pt", map_location="cpu", weights_only=True)\n',
               PRE + INIT + 'sd = torch.load("m.pt", weights_only=True)\n']),
    "DT014": (['import os\nos.environ["MASTER_PORT"] = "12355"\n',
               'import os\nos.environ["MASTER_ADDR"] = "10.0.0.5"\n',
               'import os\nos.environ.update({"MASTER_PORT": "29500"})\n'],
              ['import os\nos.environ.setdefault("MASTER_PORT", "12355")\n',
               'import os\nimport torch.multiprocessing as mp\n'
               'os.environ["MASTER_ADDR"] = "localhost"\nmp.spawn(f, nprocs=2)\n',
               'import os\nos.environ["MASTER_PORT"] = str(find_free_port())\n']),
    "DT015": ([PRE + INIT + 'local_rank = int(os.environ["LOCAL_RANK"])\n'
                            "s = DistributedSampler(ds, num_replicas=2, rank=local_rank)\n"],
              [PRE + INIT + "s = DistributedSampler(ds, rank=dist.get_rank())\n",
               PRE + INIT + "s = DistributedSampler(ds)\n"]),
    "DT016": ([PRE + INIT + "model = DDP(net)\nloader = DataLoader(ds, batch_size=32, shuffle=True)\n"],
              [PRE + INIT + "model = DDP(net)\n"
                            "loader = DataLoader(ds, sampler=DistributedSampler(ds))\n"
                            "val = DataLoader(vs, batch_size=64, shuffle=False)\n",
               "from torch.utils.data import DataLoader\nl = DataLoader(ds, shuffle=True)\n"]),
    "DT017": ([PRE + INIT + "model = DDP(net)\nif dist.get_rank() == 0:\n"
                            '    torch.save(model.state_dict(), "m.pt")\n'],
              [PRE + INIT + "model = DDP(net)\nif dist.get_rank() == 0:\n"
                            '    torch.save(model.module.state_dict(), "m.pt")\n',
               PRE + INIT + 'torch.save(model.state_dict(), "init.pt")\nmodel = DDP(model)\n']),
    "DT018": (["import torch.distributed as dist\nimport torch.multiprocessing as mp\n"
               'def work(rank, n):\n    dist.init_process_group("gloo", rank=rank, '
               "world_size=n)\n\nmp.spawn(work, args=(2,), nprocs=2)\n"],
              ["import os\nimport torch.distributed as dist\nimport torch.multiprocessing as mp\n"
               'def work(rank, n):\n    dist.init_process_group("gloo", rank=rank, '
               'world_size=n)\n\nos.environ.setdefault("MASTER_ADDR", "127.0.0.1")\n'
               'os.environ.setdefault("MASTER_PORT", "29511")\nmp.spawn(work, nprocs=2)\n',
               "import torch.distributed as dist\nimport torch.multiprocessing as mp\n"
               'def work(rank, n):\n    dist.init_process_group("gloo", '
               'init_method="tcp://127.0.0.1:29512", rank=rank, world_size=n)\n'
               "\nmp.spawn(work, nprocs=2)\n"]),
    "DT019": ([PRE + INIT + "from torch.utils.data import random_split\n"
                            "train, test = random_split(ds, [0.8, 0.2])\n",
               PRE + INIT + "from sklearn.model_selection import train_test_split\n"
                            "a, b = train_test_split(xs, test_size=0.2)\n"],
              [PRE + INIT + "from torch.utils.data import random_split\n"
                            "g = torch.Generator().manual_seed(0)\n"
                            "train, test = random_split(ds, [0.8, 0.2], generator=g)\n",
               PRE + INIT + "torch.manual_seed(42)\n"
                            "train, test = torch.utils.data.random_split(ds, [0.8, 0.2])\n",
               "import torch\ntrain, test = torch.utils.data.random_split(ds, [0.8, 0.2])\n"]),
    "DT020": ([PRE + INIT + "if torch.cuda.is_available():\n"
                            "    model = DDP(model.cuda(), device_ids=[local_rank])\n"],
              [PRE + INIT + "if torch.cuda.is_available():\n"
                            "    model = DDP(model.cuda(), device_ids=[local_rank])\n"
                            "else:\n    model = DDP(model)\n",
               PRE + INIT + "model = DDP(model, device_ids=[local_rank] if use_cuda else None)\n"]),
    "DT021": ([PRE + INIT + 'local_rank = int(os.environ["LOCAL_RANK"])\n'
                            "if local_rank == 0:\n    torch.save(model.state_dict(), 'm.pt')\n"],
              [PRE + INIT + 'rank = int(os.environ["RANK"])\n'
                            "if rank == 0:\n    torch.save(model.state_dict(), 'm.pt')\n",
               PRE + 'os.environ["MASTER_ADDR"] = "127.0.0.1"\n' + INIT
                   + 'local_rank = int(os.environ["LOCAL_RANK"])\n'
                     "if local_rank == 0:\n    torch.save(model.state_dict(), 'm.pt')\n"]),
    "DT022": ([PRE + "scaler = torch.amp.GradScaler('cuda')\n"
                     "scaler.scale(loss).backward()\n"
                     "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                     "scaler.step(opt)\n"],
              [PRE + "scaler = torch.amp.GradScaler('cuda')\n"
                     "scaler.scale(loss).backward()\nscaler.unscale_(opt)\n"
                     "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
                     "scaler.step(opt)\n",
               PRE + "if amp:\n    scaler.scale(loss).backward()\nelse:\n    loss.backward()\n"
                     "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n",
               PRE + "scaler.scale(loss).backward()\nif clip:\n    scaler.unscale_(opt)\n"
                     "    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)\n"]),
    "DT023": ([PRE + INIT + "model = DDP(model.cuda())\n",
               PRE + INIT + 'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
                            "model = DDP(model.to(device))\n"],
              [PRE + INIT + 'local_rank = int(os.environ["LOCAL_RANK"])\n'
                            "torch.cuda.set_device(local_rank)\nmodel = DDP(model.cuda())\n",
               PRE + INIT + 'model = DDP(model.to(f"cuda:{os.environ[\'LOCAL_RANK\']}"))\n',
               "import torch\nmodel = model.cuda()\n"]),
}

POSITIVE = [(r, i, s) for r, (pos, _) in CASES.items() for i, s in enumerate(pos)]
NEGATIVE = [(r, i, s) for r, (_, neg) in CASES.items() for i, s in enumerate(neg)]


def rules_of(source: str) -> list[str]:
    return [f.rule for f in lint_source(source, "t.py")]


def test_every_rule_has_cases() -> None:
    assert set(CASES) == set(RULES)
    assert list(RULES)[:10] == [f"DT{i:03d}" for i in range(1, 11)]


@pytest.mark.parametrize(("rule", "i", "source"), POSITIVE,
                         ids=[f"{r}-pos{i}" for r, i, _ in POSITIVE])
def test_rule_fires(rule: str, i: int, source: str) -> None:
    findings = [f for f in lint_source(source, "t.py") if f.rule == rule]
    assert findings, f"{rule} should fire on:\n{source}"
    f = findings[0]
    assert f.message and f.fix and f.path == "t.py" and f.line >= 1


@pytest.mark.parametrize(("rule", "i", "source"), NEGATIVE,
                         ids=[f"{r}-neg{i}" for r, i, _ in NEGATIVE])
def test_rule_silent(rule: str, i: int, source: str) -> None:
    assert rule not in rules_of(source), source


@pytest.mark.parametrize(("rule", "i", "source"), POSITIVE,
                         ids=[f"{r}-ignore{i}" for r, i, _ in POSITIVE])
def test_ignore_comment_silences_one_line(rule: str, i: int, source: str) -> None:
    line = next(f.line for f in lint_source(source, "t.py") if f.rule == rule)
    lines = source.splitlines()
    other = "DT999" if rule != "DT999" else "DT998"
    lines[line - 1] += f"  # disttrain: ignore[{other}]"
    assert rule in rules_of("\n".join(lines) + "\n"), "another rule's ignore must not silence"
    lines[line - 1] += f"  # disttrain: ignore[{rule.lower()}, {other}]"
    silenced = "\n".join(lines) + "\n"
    assert all(not (f.rule == rule and f.line == line) for f in lint_source(silenced, "t.py"))


def test_bare_ignore_silences_every_rule_on_the_line() -> None:
    src = "import torch\nsd = torch.load('m.pt')  # disttrain: ignore\nx = torch.load('n.pt')\n"
    assert [(f.rule, f.line) for f in lint_source(src)] == [("DT012", 3)]


def test_ignore_on_last_line_of_a_multiline_call() -> None:
    src = "import torch\nsd = torch.load(\n    'm.pt',\n)  # disttrain: ignore[DT012]\n"
    assert lint_source(src) == []


# -- the seed scripts and a correct one --------------------------------------------------
SEEDS = {
    "seed_000_train_ddp.py": [("DT010", 31), ("DT015", 38), ("DT005", 76), ("DT021", 96)],
    "seed_002_spawn.py": [("DT018", 6), ("DT007", 16), ("DT005", 19)],
    "seed_000_s4_dataparallel.py": [("DT001", 10)],
    "seed_000_s5_ddp.py": [("DT007", 13), ("DT007", 23)],
    "seed_000_s7_amp.py": [("DT011", 1)],
    "clean_ddp.py": [],
}


@pytest.mark.parametrize("name", list(SEEDS))
def test_seed_scripts(name: str) -> None:
    """The findings docs/troubleshooting.md lists for the guide's scripts."""
    found = [(f.rule, f.line) for f in lint_paths([SCRIPTS / name])]
    assert found == SEEDS[name]


def test_docs_list_the_seed_findings() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "troubleshooting.md").read_text()
    for name, found in SEEDS.items():
        for rule, line in found:
            assert f"{name}:{line}" in docs and rule in docs, (name, rule, line)


def test_syntax_error_is_lint_error() -> None:
    with pytest.raises(LintError, match=r"x\.py:2: cannot parse"):
        lint_source("import torch\nif True\n", "x.py")


def test_null_bytes_are_lint_error() -> None:
    with pytest.raises(LintError, match="cannot parse"):
        lint_source("x = 1\x00\n", "x.py")


def test_one_finding_per_rule_and_line() -> None:
    src = PRE + INIT + "print(1); print(2)\n" + END
    assert rules_of(src).count("DT004") == 1


def test_repository_example_lints_clean() -> None:
    """The example users copy (examples/train_ddp.py) must pass its own checklist."""
    example = Path(__file__).parents[2] / "examples" / "train_ddp.py"
    if not example.exists():
        pytest.skip("examples/train_ddp.py not written yet")
    assert [(f.rule, f.line) for f in lint_paths([example])] == []


def test_dt002_cpu_path_names_the_script_fix() -> None:
    """A hard-coded nccl next to a CPU fallback: the fix is the conditional backend."""
    src = (PRE + 'device = "cuda" if torch.cuda.is_available() else "cpu"\n'
           'dist.init_process_group("nccl")\nmodel = model.to(device)\n')
    found = [f for f in lint_source(src, "t.py") if f.rule == "DT002"]
    assert len(found) == 1 and "CPU path" in found[0].message
    assert '"nccl" if torch.cuda.is_available() else "gloo"' in found[0].fix
