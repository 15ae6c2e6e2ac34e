"""A training process for the async crash test: ``python -m tests.async_child URL OPTIONS_JSON STOP_AT``.

It commits iteration 1 synchronously, then starts an asynchronous save of iteration 2, and
waits to be SIGKILLed by the test. The background save process stops at a known point first,
``STOP_AT``: ``before-commit`` (every key written, the commit record and pointer not) or
``after-commit`` (the pointer moved). It gets there because ``spawn`` imports this module in
the background process too, which then wraps ``commit.publish`` (below): at the point it
creates ``{MARKER_DIR}/{STOP_AT}`` and blocks, so the test kills at exactly that phase.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from dcp_fsspec import Checkpointer
from dcp_fsspec.checkpoint.commit import committing

STEP1 = {"w": torch.arange(1000.0)}
STEP2 = {"w": torch.arange(1000.0) * 2}
STOP_AT_ENV = "DCP_FSSPEC_TEST_STOP_AT"  # "<phase>:<marker folder>", inherited by the background process


def _stop_in_background_process() -> None:
    phase, marker_dir = os.environ[STOP_AT_ENV].split(":", 1)
    real_publish = committing.publish

    def publish(*args: Any, **kwargs: Any) -> int:
        if phase == "before-commit":
            Path(marker_dir, phase).touch()
            threading.Event().wait()  # until the training process is killed and this one follows
        latest = real_publish(*args, **kwargs)
        Path(marker_dir, phase).touch()
        threading.Event().wait()
        return latest

    committing.publish = publish  # type: ignore[assignment]


if __name__ == "__mp_main__" and STOP_AT_ENV in os.environ:  # spawn's name for the re-imported main
    _stop_in_background_process()


def main() -> None:
    url, options = sys.argv[1], json.loads(sys.argv[2])
    with Checkpointer(url, options) as sync:
        sync.save(1, trainer=STEP1)
    ckpt = Checkpointer(url, options, async_mode="async_with_pinned_mem")
    ckpt.save(2, trainer=STEP2)
    print(f"SAVING {ckpt._async.saver.pid}", flush=True)  # type: ignore[union-attr]
    threading.Event().wait(600)


if __name__ == "__main__":
    main()
