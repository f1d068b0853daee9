"""A private folder for the files torch's elastic agent writes during one launch, removed
when the launch ends.

    with agent_scratch() as scratch:
        config = launch_config(..., scratch_dir=scratch)
        elastic_launch(config, entry)(...)

Why: after each launch torch 2.13 leaves files in /tmp, and nothing removes them:
- its default logs spec (`DefaultLogsSpecs()`) makes one torchelastic_* folder per launch;
- for a function entry the agent calls `torch.multiprocessing.start_processes`. That names
  one error file per worker, `NamedTemporaryFile(prefix="pytorch-errorfile-",
  delete=False)`. A worker that raises writes its traceback there, and the file stays. A
  traceback can show a user's paths and values.
One run of this project's suite (stop 36's CI) left 60 such files and 192 torchelastic_*
folders in /tmp, some of them from tests that run plain torchrun on purpose.

The first file kind goes in `scratch_dir`. The second takes its folder from
`tempfile.gettempdir()`, so `tempfile.tempdir` points at the scratch folder while the
launch runs. multiprocessing's own temp folder is made before that, where it would be
anyway: the forkserver's socket lives there and must outlive the launch.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def agent_scratch() -> Iterator[Path]:
    """A fresh folder that is also this process's temp folder until the block ends; the
    folder and all in it are removed then, and the temp folder is restored."""
    import multiprocessing.util

    multiprocessing.util.get_temp_dir()   # made now, in the real temp folder
    with tempfile.TemporaryDirectory(prefix="disttrain-agent-") as scratch:
        saved = tempfile.tempdir
        tempfile.tempdir = scratch
        try:
            yield Path(scratch)
        finally:
            tempfile.tempdir = saved
