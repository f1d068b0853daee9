"""Hostile input never crashes the tool: property-based fuzzing (hypothesis) of specs,
flags, rendered manifests, logs, checkpoints and the fault hook.

Every property is "a result or the documented error, nothing else": SpecError for specs,
exit code 0 or 2 with an `error:` line for the command line, CheckpointError for
checkpoint files. Under `make test` the inputs are the same on every run (the "ci"
profile of tests/conftest.py), plus the `@example`s that once found a bug; `make fuzz`
draws fresh ones, ten times as many, to find the next.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from disttrain.cli.main import cli
from disttrain.cli.options import HIDDEN
from disttrain.diagnose import logs as logs_mod
from disttrain.errors import SpecError
from disttrain.k8s import render as render_mod
from disttrain.spec.job import JobSpec, field_index

# The profile's max_examples over hypothesis' default of 100: 1 under "ci", 10 under "fuzz".
SCALE = settings.default.max_examples / 100
pytestmark = pytest.mark.timeout(round(240 * SCALE))
LONG_NAME = "[" * 300  # longer than a file name may be (255): stat raises ENAMETOOLONG


def fuzz(n: int) -> Any:
    """`n` examples per test in `make test`, scaled by the loaded profile (`make fuzz`)."""
    return settings(max_examples=max(1, round(n * SCALE)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- inputs ----------------------------------------------------------------------------
INDEX = field_index()
FIELDS = sorted(INDEX)
SECTIONS = ("launch", "train", "cluster")
TRICKY_TEXT = [
    "", " ", "auto", "0", "-1", "1e309", "nan", "inf", ".inf", "~", "null", "true", "2024-02-30",
    "[2024-02-30]", "{a: 2024-02-30}", "a\x00b", "'", '"', "[" * 2000, "{a: [" * 300,
    "!!binary aGk=", "!!python/object/apply:os.system ['true']", "&a [*a]", "*x", "ddp", "pod",
    "job", "pytorchjob", "train.py", "--", "-f", "12k", "8Gi", "500m", "/abs/path", "rel/path",
    "{request: '2', limit: '1'}", "[{name: data, pvc: nfs, mount: /data}]", "{configmap: false}",
    "GPU-03f69c50-207a-2038-9b45-23cac89cb67d", "1:2", "a" * 300, "é漢字", "\t\n",
]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                    st.text(max_size=20), st.sampled_from(TRICKY_TEXT))
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(max_size=8), st.integers()),
                                            inner, max_size=4)),
    max_leaves=12)
keys = st.one_of(st.sampled_from(FIELDS + list(SECTIONS)), st.text(max_size=8))
sections = st.fixed_dictionaries({}, optional={s: st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5), values) for s in SECTIONS})
documents = st.one_of(
    st.builds(lambda a, b: {**a, **b}, sections, st.dictionaries(keys, values, max_size=4)),
    values)
flag_value = st.one_of(st.sampled_from(TRICKY_TEXT), st.text(max_size=30),
                       st.integers(-10**20, 10**20).map(str), st.floats().map(str))


def flags(sections_: tuple[str | None, ...]) -> Any:
    names = sorted("--" + n.replace("_", "-") for n, (sec, _) in INDEX.items()
                   if sec in sections_ and n not in HIDDEN)
    pairs = st.lists(st.tuples(st.sampled_from(names), flag_value), max_size=5)
    return pairs.map(lambda ps: [x for p in ps for x in p])


def invoke(argv: list[str]) -> Any:
    """Run the CLI in this process; fail on anything but exit 0, or 2 with `error:`."""
    res = CliRunner().invoke(cli, argv, catch_exceptions=True)
    exc = res.exception
    if exc is not None and not isinstance(exc, SystemExit):
        raise AssertionError(f"uncaught {type(exc).__name__}: {exc} for {argv!r}") from exc
    assert res.exit_code in (0, 2), (argv, res.exit_code, res.output[-2000:])
    if res.exit_code == 2:
        assert "error:" in res.output.lower() and "Traceback" not in res.output, res.output
    return res


# -- specs -----------------------------------------------------------------------------
@fuzz(300)
@given(documents, st.dictionaries(st.sampled_from(FIELDS), values, max_size=3))
@example({"cluster": {"image": "a\x00b"}}, {})
@example({"cluster": {"env": {"A": "a\x00b"}}}, {"scheduler": "x\x00"})
def test_spec_from_dict_is_a_spec_or_a_spec_error(data, overrides):
    try:
        spec = JobSpec.from_dict(data, overrides)
    except SpecError as exc:
        assert str(exc).strip()
        return
    JobSpec.model_validate(yaml.safe_load(spec.to_yaml()))  # what is written reloads


@fuzz(200)
@given(st.one_of(st.text(max_size=300), st.sampled_from(TRICKY_TEXT),
                 documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                 st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_spec_file_is_a_spec_or_a_spec_error(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            JobSpec.from_yaml(path)
        except SpecError as exc:
            assert str(path) in str(exc)


def test_known_hostile_spec_values_are_refused_with_the_field_named():
    for doc, needle in [
        ("launch: {timeout_s: .inf}", "launch.timeout_s"),
        ("launch: {timeout_s: 1e308}", "launch.timeout_s"),
        ("train: {seed: 99999999999999999999999}", "train.seed"),
        ("launch: {nproc_per_node: 100000}", "launch.nproc_per_node"),
        ("train: {threads: 2147483648}", "train.threads"),
        ('args: ["a\\0b"]', "args"),
        ("train: {run_dir: \"x\\0\"}", "train.run_dir"),
    ]:
        with pytest.raises(SpecError, match=needle):
            JobSpec.from_dict(yaml.safe_load(doc))
    with tempfile.TemporaryDirectory() as tmp:
        for text in ("a: 2024-02-30\n", "[" * 5000):
            (Path(tmp) / "j.yaml").write_text(text)
            with pytest.raises(SpecError, match=r"j\.yaml"):
                JobSpec.from_yaml(Path(tmp) / "j.yaml")
        with pytest.raises(SpecError, match="cannot read"):
            JobSpec.from_yaml(Path(tmp) / "a\x00b.yaml")


# -- the command line --------------------------------------------------------------------
@fuzz(150)
@given(flags((None, "launch", "train")))
@example([LONG_NAME])
@example(["--example", "mnist", "--data-dir", LONG_NAME])
def test_run_flags_exit_0_or_2(argv):
    invoke(["run", "--dry-run", *argv])


@fuzz(100)
@given(documents, flags((None, "launch", "train")))
def test_run_spec_file_exits_0_or_2(doc, argv):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
        invoke(["run", "--dry-run", "-f", str(path), *argv])


@pytest.mark.parametrize("argv", [
    ["run", "--dry-run", "-f", "a\x00b.yaml"],
    ["run", "--dry-run", "a\x00b.py"],
    ["run", "--dry-run", "--timeout-s", "inf"],
    ["run", "--dry-run", "--run-dir", "a\x00b"],
    ["run", "--dry-run", "--nproc-per-node", "100000"],
    ["run", "--dry-run", "x" * 5000],
    ["k8s", "render", "--image", "r/i:1", "--cpu", "[" * 3000],
    ["k8s", "render", "--image", "r/i:1", "--volumes", "[2024-02-30]"],
    ["k8s", "render", "--image", "r/i:1", "-f", "a\x00"],
])
def test_known_hostile_command_lines_exit_2(argv):
    assert invoke(argv).exit_code == 2


# -- manifests -------------------------------------------------------------------------
cluster_docs = st.fixed_dictionaries(
    {"image": st.sampled_from(["reg.local:5000/pytorch/pytorch:2.1.0", "img", "a/b:c"])},
    optional={
        "kind": st.sampled_from(["pod", "job", "pytorchjob"]),
        "gpus": st.integers(0, 9),
        "gpumem": st.one_of(st.integers(1, 100_000), st.sampled_from(["12k", "8Gi", "0"])),
        "gpumem_percentage": st.integers(0, 101), "gpucores": st.integers(-1, 101),
        "namespace": st.sampled_from(["default", "ml", "Bad_NS", ""]),
        "scheduler": st.sampled_from(["hami-scheduler", None, "volcano"]),
        "node_selector": st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=2),
        "env": st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=10), max_size=3),
        "cpu": st.fixed_dictionaries({}, optional={"request": st.sampled_from(["1", "2", "500m", "x"]),
                                                   "limit": st.sampled_from(["1", "8", "100m"])}),
        "memory": st.fixed_dictionaries({}, optional={"request": st.sampled_from(["1Gi", "8Gi"]),
                                                      "limit": st.sampled_from(["512Mi", "16Gi"])}),
        "code": st.sampled_from([{}, {"host_path": "/opt/code", "mount": "/workspace"},
                                 {"pvc": "code-pvc", "mount": "/workspace"}, {"configmap": False}]),
        "volumes": st.lists(st.fixed_dictionaries(
            {"name": st.sampled_from(["data", "models", "ckpt", "code"]),
             "mount": st.sampled_from(["/data", "/models", "rel"])},
            optional={"pvc": st.sampled_from(["nfs-data", "Bad_PVC"]),
                      "host_path": st.sampled_from(["/mnt/data", "/"]),
                      "read_only": st.booleans(), "create": st.booleans(),
                      "size": st.sampled_from(["50Gi", "x"]),
                      "access_mode": st.sampled_from(["ReadWriteOnce", "ReadWriteMany"])}),
            max_size=3),
        "add_capabilities": st.lists(st.sampled_from(["IPC_LOCK", "SYS_ADMIN", "NET_ADMIN",
                                                      "CHOWN", "bad-cap"]), max_size=2),
        "nccl_preset": st.sampled_from(["default", "debug", "no-ib", "ib"]),
        "shm": st.sampled_from(["2Gi", None, "64Gi", "x"]),
        "image_has_disttrain": st.booleans(),
        "install_disttrain": st.sampled_from([None, "disttrain==0.1.0", "bad req; rm -rf /"]),
        "elastic_nodes": st.sampled_from([None, "1:2", "2:1", "x"]),
    })
job_docs = st.fixed_dictionaries(
    {"cluster": cluster_docs},
    optional={"name": st.sampled_from(["mnist-ddp", "a", "x" * 70, "1job"]),
              "script": st.sampled_from(["train.py", "missing.py"]),
              "launch": st.fixed_dictionaries({}, optional={
                  "nnodes": st.integers(1, 5), "nproc_per_node": st.integers(1, 8),
                  "master_port": st.sampled_from([0, 29500, 12355]),
                  "max_restarts": st.integers(0, 3), "backend": st.sampled_from(["auto", "nccl"])}),
              "train": st.fixed_dictionaries({}, optional={"epochs": st.integers(1, 3)})})


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        return [spec]
    if obj["kind"] == "Job":
        return [spec["template"]["spec"]]
    if obj["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in spec["pytorchReplicaSpecs"].values()]
    return []


@fuzz(120)
@given(job_docs)
def test_render_returns_objects_or_a_spec_error_with_secure_pods(tmp_path_factory, doc):
    base = tmp_path_factory.getbasetemp()
    (base / "train.py").write_text("print('hi')\n")
    try:
        spec = JobSpec.from_dict(doc)
        rendered = render_mod.render(spec, base_dir=base)
    except SpecError as exc:
        assert str(exc).strip()
        return
    asked = set(spec.cluster.add_capabilities)
    for obj in rendered.objects:
        for pod in _pod_specs(obj):
            assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), pod
            for ctr in pod["containers"]:
                sc = ctr["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
                assert sc["capabilities"]["drop"] == ["ALL"]
                assert set(sc["capabilities"].get("add", [])) == asked
            if any("hostPath" in v for v in pod.get("volumes", [])):
                assert any("hostPath" in w and "baseline" in w for w in rendered.warnings)
    render_mod.to_yaml(rendered.objects)


@fuzz(60)
@given(flags((None, "launch", "train", "cluster")))
@example(["--image-has-disttrain", "[" * 2000])  # SCRIPT too long a name: was an OSError
@example(["--code", "{files: [%s]}" % ("x" * 300)])
def test_k8s_render_flags_exit_0_or_2(argv):
    invoke(["k8s", "render", "--image", "reg.local/pytorch:1", *argv])


# -- logs, checkpoints, the fault hook ---------------------------------------------------
OUR_LINES = [
    "error: rank 1 (pid 4242, host vm) made no progress for 30 s; last seen: step 17, phase "
    "backward; the process is not running (stopped, or blocked holding the GIL)\n",
    "error: the job failed (failed rank(s): 0, 1)\n",
    "disttrain fault injection (testing only): stop rank 1 pid 9 at step 3, phase forward\n",
    "warning: skipping checkpoint runs/x/checkpoints/ckpt-00000030.pt: corrupt (entry "
    "archive/data/5 fails its CRC-32 check)\n", "resumed from runs/x/last.pt (epoch 1, step 23)\n",
    "[rank1]:", "Traceback (most recent call last):\n", "RuntimeError: boom\n",
]


@fuzz(80)
@given(st.lists(st.one_of(st.sampled_from(OUR_LINES), st.text(max_size=80)), max_size=30))
def test_diagnose_never_raises_on_our_own_output(parts):
    d = logs_mod.diagnose("".join(parts))
    logs_mod.format_diagnosis(d)


@fuzz(60)
@given(st.binary(max_size=3000))
def test_random_bytes_are_never_a_checkpoint(data):
    from disttrain.errors import CheckpointError
    from disttrain.train.checkpoint import load_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt-00000001.pt"
        path.write_bytes(data)
        with pytest.raises(CheckpointError):
            load_checkpoint(path)


@fuzz(150)
@given(st.one_of(st.text(max_size=60), st.sampled_from(
    ["kill:rank=1:step=2", "stop:rank=0:step=0:phase=eval:restart=2", "kill:rank=:step=1"])))
def test_fault_hook_parses_or_says_the_expected_form(text):
    from disttrain.resilience.faults import Fault

    try:
        Fault.parse(text)
    except ValueError as exc:
        assert "expected ACTION:rank=R:step=S" in str(exc)
