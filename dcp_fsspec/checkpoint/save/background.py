"""The background process that writes asynchronous saves: every key, the commit, retention.

One process per checkpointer and rank, started with ``spawn`` when the Checkpointer is built and
kept until ``finalize``. Starting it returns at once; the first save waits until it is up (its
imports take seconds), so a training run's first steps overlap them. It receives staged state dicts (their tensors in shared memory, so only
handles cross the pipe, and each buffer's only once: :mod:`~dcp_fsspec.checkpoint.save.handles`) and runs the same
:class:`~dcp_fsspec.checkpoint.save.pipeline.SavePipeline` as a synchronous save, built from the picklable
:class:`~dcp_fsspec.checkpoint.save.pipeline.SaveSettings` it is started with, on a process group of its own (gloo, over a
TCP store that rank 0's background process hosts): its collectives can never interleave with
training's. :class:`ThreadSaver` keeps the same contract in a thread, for ``memory://``.

Failure rules: an exception in the background is sent back and raised in the training process
at its next ``save``/``wait``/``finalize``; a background process that dies is reported as such
(never a hang); and a background process whose training process dies exits at once (it watches
its parent), leaving the previous checkpoint and pointer untouched.
"""

from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from dcp_fsspec.checkpoint.collectives import Collectives, _picklable
from dcp_fsspec.checkpoint.save.handles import HandleReceiver, HandleSender
from dcp_fsspec.checkpoint.save.pipeline import Saved, SavePipeline, SaveSettings
from dcp_fsspec.errors import BackgroundSaveError, add_note
from dcp_fsspec.storage.transport.urls import redact_url

logger = logging.getLogger(__name__)

_PACKAGE_LOGGER = "dcp_fsspec"
# How often each side checks that the other is still alive.
_POLL_SECONDS = 0.2
_STORE_TIMEOUT_SECONDS = 300
# The exit code of a background process that found itself re-running an unguarded main script.
_REIMPORTED_MAIN_EXIT = 77


class BackgroundSaver:
    """The training side of the background process: submit one save at a time, wait, close.

    Building one starts the process and returns without waiting for it. The first
    :meth:`submit` waits until it is up; with several ranks that wait is a collective (the
    background processes form their group then), as every save is.
    """

    def __init__(self, settings: SaveSettings, collectives: Collectives) -> None:
        self._url = redact_url(settings.url)  # for messages; settings keep the password to connect
        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve,
            args=(
                child_end,
                settings,
                collectives.rank,
                collectives.world_size,
                collectives.distributed,
                os.getpid(),
                logging.getLogger(_PACKAGE_LOGGER).getEffectiveLevel(),
            ),
            name=f"dcp-fsspec-saver-{collectives.rank}",
            daemon=True,
        )
        self._process.start()
        child_end.close()  # so recv() here fails fast if the child dies
        self._collectives = collectives
        self._inflight: int | None = None
        self._ready = False
        self._handles = HandleSender()
        # Sends on the pipe come from the training thread and from the hand-over thread.
        self._sending = threading.Lock()
        self._ahead: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def in_flight(self) -> int | None:
        """The iteration being written, if any."""
        return self._inflight

    def submit(self, iteration: int, staged: dict[str, dict[str, Any]], save_id: str | None = None) -> None:
        """Hand a staged save to the background process; the caller must :meth:`wait` first.

        ``save_id``: see :meth:`~dcp_fsspec.checkpoint.SavePipeline.run`."""
        assert self._inflight is None, "one save at a time: wait() before submit()"
        self._wait_until_up()
        self._join_hand_over()
        self._inflight = iteration
        try:
            packed, used = self._handles.pack(staged)
            self._send(("save", iteration, packed, used, save_id))
        except OSError:  # the pipe broke: the process is gone
            self._process.join(timeout=5)
            self._died()

    def hand_over(self, buffers: Future[dict[Any, torch.Tensor]]) -> None:
        """Share ``buffers`` with the background process on a thread, once they are allocated.

        Sharing a buffer costs a file descriptor and a lookup on the other side; done here, before
        the first save, that save sends only the buffers' tokens, as later ones do. A failed
        allocation or a closed pipe is left to the next save to report.
        """
        self._join_hand_over()

        def run() -> None:
            try:
                tensors = list(buffers.result().values())
                with self._sending:
                    packed, _ = self._handles.pack(tensors)
                    self._conn.send(("buffers", packed))
            except Exception:  # noqa: BLE001 - the next save() raises the allocation's error or the death
                logger.debug("handing staging buffers to the background process failed", exc_info=True)

        self._ahead = threading.Thread(target=run, name="dcp-fsspec-hand-over", daemon=True)
        self._ahead.start()

    def _join_hand_over(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.join()

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._sending:
            self._conn.send(message)

    def wait(self, timeout: float | None = None) -> Saved | None:
        """Block until the save in flight is committed; raise its error if it failed.

        Returns:
            What the save did (``None``: none was in flight).

        Raises:
            TimeoutError: ``timeout`` seconds passed first; the save goes on, still in flight.
        """
        if self._inflight is None:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            saved: Saved = self._receive("done", deadline)
        except TimeoutError:
            raise
        except BaseException:
            self._inflight = None
            raise
        self._inflight = None
        return saved

    def close(self) -> None:
        """Wait for the save in flight, then stop the process; raise the save's error if any."""
        try:
            self.wait()
        finally:
            if not self._ready:
                # It never received a save, so it has touched nothing: stop it mid-import.
                self._process.terminate()
            elif self._process.is_alive():
                try:
                    self._send(("stop",))
                except OSError:
                    pass
            self._process.join(timeout=30)
            self._join_hand_over()  # its send fails once the process is gone
            if self._process.is_alive():  # pragma: no cover - only if the child is wedged
                self._process.kill()
                self._process.join()
            self._conn.close()

    def _wait_until_up(self) -> None:
        """Wait until the process has started; with several ranks, form its group first."""
        if self._ready:
            return
        if self._collectives.distributed:
            # Rank 0's background process hosts the store; everyone learns its port from rank 0.
            port = self._collectives.run_on_rank0(lambda: self._receive("port"))
            self._send(("connect", os.environ.get("MASTER_ADDR", "127.0.0.1"), port))
        self._receive("ready")

    def _receive(self, expected: str, deadline: float | None = None) -> Any:
        while True:
            try:
                if self._conn.poll(_POLL_SECONDS):
                    break
            except (EOFError, OSError):
                break  # recv() below reports it
            if not self._process.is_alive():
                self._died()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the background save to {self._url} did not finish in time")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):  # the other end is gone
            self._process.join(timeout=5)
            self._died()
        kind, payload = message[0], message[1:]
        if kind == "ready":
            self._ready = True
        if kind in ("done", "error"):
            *payload, records = payload
            _replay(records)
        if kind == "error":
            error, trace = payload
            add_note(error, f"(raised in the background save process for {self._url})\n{trace}")
            raise error
        if kind != expected:  # pragma: no cover - a protocol bug
            raise BackgroundSaveError(
                f"background saver for {self._url} sent {kind!r}, expected {expected!r}"
            )
        return payload[0] if payload else None

    def _died(self) -> NoReturn:
        if not self._ready:
            script = unguarded_main_script()
            if self._process.exitcode == _REIMPORTED_MAIN_EXIT or script is not None:
                # Not chained to the EOFError that revealed it: that says nothing more.
                raise BackgroundSaveError(
                    f"the background save process for {self._url} could not start: "
                    f'{script or "the main script"} has no `if __name__ == "__main__":` block, and '
                    "'spawn' re-runs the script from the top in the new process. Put the training code "
                    'under `if __name__ == "__main__":`, or use async_mode="disabled"'
                ) from None
        what = f"saving iteration {self._inflight}" if self._inflight is not None else "idle"
        self._inflight = None
        raise BackgroundSaveError(
            f"the background save process for {self._url} died (exit code {self._process.exitcode}) "
            f"while {what}; that save did not commit and the pointer did not move. The next save() "
            "starts a new background process"
        ) from None


class ThreadSaver:
    """The same contract in a thread, for ``memory://`` (which another process cannot see).

    Only for a single process: with several ranks the saves' collectives would share training's
    process group.

    Args:
        save: runs one staged save to its commit (:meth:`SavePipeline.run`).
    """

    def __init__(self, save: Callable[[int, dict[str, dict[str, Any]], str | None], Saved]) -> None:
        self._save = save
        self._inflight: int | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._saved: Saved | None = None

    @property
    def in_flight(self) -> int | None:
        return self._inflight

    def submit(self, iteration: int, staged: dict[str, dict[str, Any]], save_id: str | None = None) -> None:
        assert self._inflight is None, "one save at a time: wait() before submit()"

        def run() -> None:
            try:
                self._saved = self._save(iteration, staged, save_id)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e

        self._inflight = iteration
        self._thread = threading.Thread(target=run, name="dcp-fsspec-saver", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> Saved | None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the save of iteration {self._inflight} did not finish in time")
        self._thread, self._inflight = None, None
        error, self._error = self._error, None
        saved, self._saved = self._saved, None
        if error is not None:
            raise error
        return saved

    def close(self) -> None:
        self.wait()


def leave_if_reimported_main() -> None:
    """In a process that ``spawn`` is starting, while it re-runs the main script: exit quietly.

    A script without ``if __name__ == "__main__":`` reaches its Checkpointer again there. Going on
    would print the tracebacks of a nested spawn; the exit code tells the training process, which
    raises one :class:`~dcp_fsspec.errors.BackgroundSaveError` saying what to add.
    """
    # The flag multiprocessing itself checks to refuse a process started while bootstrapping.
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(_REIMPORTED_MAIN_EXIT)


def unguarded_main_script() -> str | None:
    """The running script, if spawning a process would re-run its training code.

    ``spawn`` starts a fresh interpreter that imports the main script as a module; code at its
    top level runs again unless it sits under ``if __name__ == "__main__":``. Read from the
    script's syntax (never run): ``None`` when there is no script file (``python -c``, a
    notebook) or it has that block.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    guarded = any(isinstance(node, ast.If) and _tests_for_main(node.test) for node in tree.body)
    return None if guarded else str(path)


def _tests_for_main(test: ast.expr) -> bool:
    """Whether ``test`` is ``__name__ == "__main__"`` (either way round, maybe inside an ``and``)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_tests_for_main(v) for v in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    values = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and values == {"__main__"}


# --- the background process ------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the training process is gone (so no orphan keeps writing)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(_POLL_SECONDS)


def _serve(
    conn: Connection,
    settings: SaveSettings,
    rank: int,
    world_size: int,
    distributed: bool,
    parent_pid: int,
    log_level: int,
) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    logs = _ForwardedLogs()
    package_logger = logging.getLogger(_PACKAGE_LOGGER)
    package_logger.addHandler(logs)
    package_logger.setLevel(log_level)
    package_logger.propagate = False
    handles = HandleReceiver()
    try:
        if distributed:
            _join_group(conn, handles, rank, world_size)
        pipeline = SavePipeline(settings, Collectives())
        conn.send(("ready",))
    except BaseException as e:  # noqa: BLE001 - reported to the training process
        error = _picklable(e if isinstance(e, Exception) else RuntimeError(repr(e)), rank)
        conn.send(("error", error, traceback.format_exc(), logs.take()))
        return
    try:
        while True:
            try:
                message = _request(conn, handles)
            except EOFError:
                return  # the training process closed its end
            if message[0] == "stop":
                return
            _, iteration, packed, used, save_id = message
            try:
                saved = pipeline.run(iteration, handles.unpack(packed, used), save_id)
                conn.send(("done", saved, logs.take()))
            except Exception as e:  # noqa: BLE001 - reported, then the next request is served
                conn.send(("error", _picklable(e, rank), traceback.format_exc(), logs.take()))
            del packed
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


class _ForwardedLogs(logging.Handler):
    """The background process's log records of one save, sent back with its outcome.

    The training process's logging configuration is the user's; the background process has none.
    Its records (commits, retention deletions, warnings) are replayed there, so a user sees them
    where they see everything else.
    """

    def __init__(self) -> None:
        super().__init__()
        self._records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self._records.append((record.name, record.levelno, record.getMessage()))

    def take(self) -> list[tuple[str, int, str]]:
        records, self._records = self._records, []
        return records


def _replay(records: list[tuple[str, int, str]]) -> None:
    for name, level, message in records:
        logging.getLogger(name).log(level, "%s (in the background save process)", message)


def _request(conn: Connection, handles: HandleReceiver) -> tuple[Any, ...]:
    """The next request from the training process; buffers handed over ahead are kept on the way."""
    while True:
        message = conn.recv()
        if message[0] != "buffers":
            return message
        handles.keep(message[1])


def _join_group(conn: Connection, handles: HandleReceiver, rank: int, world_size: int) -> None:
    """Form this background process's own gloo group with the other ranks' background processes."""
    from datetime import timedelta

    timeout = timedelta(seconds=_STORE_TIMEOUT_SECONDS)
    store = None
    if rank == 0:
        # TCPStore binds every interface when it opens its own socket, whatever its host_name;
        # handed a socket already bound to the training group's address, it listens only there.
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        family, _, _, _, address = socket.getaddrinfo(master, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind(address)  # port 0: the OS picks it; the training ranks pass it on
        listener.listen()
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            master,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns the socket from here on
        )
        conn.send(("port", store.port))
    kind, host, port = _request(conn, handles)
    if kind != "connect":  # pragma: no cover - a protocol bug
        raise RuntimeError(f"expected the store address, got {kind!r}")
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
