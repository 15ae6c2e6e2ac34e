"""The README's main job: train, checkpoint to S3, stop, resume in a fresh process, compare.

With no setup it starts a real S3 API on 127.0.0.1 (``LocalS3Server``), trains a small MLP on
seeded synthetic data on the CPU, checkpoints every k steps with :class:`Checkpointer`, stops
part way, then runs this same module in a fresh Python process that resumes from the latest
checkpoint and trains to the end. The result must match an uninterrupted run bit for bit (final
weights and final loss), and a short table shows what was saved, its size and how long each save took.
"""

from __future__ import annotations

import argparse
import json
import sys

DEMO_BUCKET = "dcp-fsspec-demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` subcommand's options."""
    parser.add_argument(
        "--url", help="checkpoint to this URL instead of an embedded S3 server (must hold no checkpoint)"
    )
    parser.add_argument(
        "--storage-options", default="{}", metavar="JSON", help="fsspec options for --url, as a JSON object"
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps in all (default: 300)")
    parser.add_argument(
        "--every", type=int, default=50, help="checkpoint every this many steps (default: 50)"
    )
    parser.add_argument(
        "--stop-at", type=int, default=170, help="the first process stops after this step (default: 170)"
    )
    parser.add_argument("--keep-last-n", type=int, default=3, help="checkpoints to keep (default: 3)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the model, the data and the teacher (default: 0)"
    )
    parser.add_argument("--resume-worker", action="store_true", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the ``demo`` subcommand; the exit status."""
    if args.resume_worker:
        from dcp_fsspec.demo_training import resume_worker  # torch: only once the work starts

        return resume_worker(sys.stdin.read())
    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--storage-options is not valid JSON: {e}") from e
    if not isinstance(options, dict):
        raise SystemExit(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    if not 0 < args.stop_at < args.steps or args.every < 1:
        raise SystemExit("need 0 < --stop-at < --steps and --every >= 1")
    from dcp_fsspec.checkpoint import Checkpointer  # torch: only once the arguments are checked
    from dcp_fsspec.demo_training import DemoConfig, run_demo
    from dcp_fsspec.storage.transport.urls import resolve

    cfg = DemoConfig(
        args.url or "", options, args.steps, args.every, args.stop_at, args.keep_last_n, args.seed
    )

    if cfg.url and not resolve(cfg.url, cfg.storage_options).backend.shared_across_processes:
        raise SystemExit(
            f"--url {cfg.url}: that store lives in one process, and the demo resumes in a fresh one"
        )
    if cfg.url:
        with Checkpointer(cfg.url, cfg.storage_options) as probe:
            if probe.latest_checkpoint() is not None:
                raise SystemExit(f"{probe.url} already holds checkpoints; point --url at an empty location")
        ok = run_demo(cfg)
        print(f"the checkpoints stay at {cfg.url}: try `dcp-fsspec ls {cfg.url}`")
        return 0 if ok else 1
    from dcp_fsspec.local_s3 import LocalS3Server

    with LocalS3Server() as server:
        server.create_bucket(DEMO_BUCKET)
        cfg.url = f"s3://{DEMO_BUCKET}/run1/checkpoints"
        cfg.storage_options = server.storage_options()
        print(f"embedded S3 server (moto) at {server.endpoint_url}")
        ok = run_demo(cfg)
    print("the embedded S3 server has stopped, and its checkpoints with it. To keep them, run")
    print("`dcp-fsspec demo --url runs/demo` (a folder) or --url s3://bucket/prefix with --storage-options.")
    return 0 if ok else 1
