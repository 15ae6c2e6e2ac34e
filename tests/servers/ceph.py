"""Ceph's RADOS Gateway on 127.0.0.1: the S3 server many production clusters run.

One monitor, one BlueStore OSD on a sparse file, no manager, no authentication between the
daemons, and ``radosgw``; each a foreground child process, every port chosen free. About 20 s to
start, and the OSD's file grows with the bytes written (~10 GB for a 1 GiB benchmark). Optional:
it needs Debian's ``radosgw ceph-mon ceph-osd ceph-common`` packages (``apt-get install -y
--no-install-recommends …``); without them its tests are skipped, under ``CI=true`` too.

Tuned for less CPU per byte on loopback with throwaway data (no data CRCs on the wire or the
disk, 16 MiB RADOS chunks), as a benchmark wants; the S3 behaviour is Ceph's own.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tests.servers import ServerUnavailable, dying_with_parent, stop_process
from tests.servers.s3gateway import ACCESS_KEY, SECRET_KEY, S3Gateway, free_port, wait_for_http

PROGRAMS = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool")
INSTALL = "apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd ceph-common"


def _config(folder: Path, mon_v2: int, mon_v1: int, rgw_port: int, disk_gib: int) -> str:
    mon = f"[v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]"
    return f"""[global]
fsid = {uuid.uuid4()}
mon_host = {mon}
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_ipv4 = true
ms_bind_ipv6 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
# radosgw asks for 'secure' connections to the monitor by default: impossible without cephx
ms_mon_client_mode = crc
ms_client_mode = crc
ms_service_mode = crc
ms_cluster_mode = crc
ms_mon_service_mode = crc
ms_mon_cluster_mode = crc
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_data_avail_warn = 1
ms_crc_data = false
bluestore_csum_type = none
run_dir = {folder}/run
log_file = {folder}/log/$name.log
admin_socket = {folder}/run/$name.asok
keyring = {folder}/keyring
[mon]
mon_data = {folder}/mon/$name
[osd]
osd_data = {folder}/osd/$name
osd_objectstore = bluestore
bluestore_block_path = {folder}/osd/$name.block
bluestore_block_size = {disk_gib << 30}
bluestore_block_create = true
bluestore_block_db_create = false
bluestore_block_wal_create = false
osd_memory_target = 1610612736
osd_max_object_size = 1073741824
[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw_data = {folder}/rgw
rgw_dns_name = localhost
# overwritten and deleted objects hold OSD space until RGW's garbage collection: run it often
rgw_gc_obj_min_wait = 10
rgw_gc_processor_period = 15
rgw_max_chunk_size = 16777216
rgw_put_obj_min_window_size = 67108864
rgw_get_obj_window_size = 67108864
rgw_get_obj_max_req_size = 16777216
"""


class LocalCephRGW(S3Gateway):
    """A one-OSD Ceph cluster and ``radosgw`` in child processes, under a temporary folder
    (or ``data_dir``, emptied first) that :meth:`stop` removes.

    Args:
        data_dir: where the cluster keeps everything; a new temporary folder by default.
        disk_gib: the OSD's (sparse) disk size: it must hold every object stored at once.
    """

    name = "Ceph RGW"

    def __init__(self, data_dir: str | None = None, disk_gib: int = 24) -> None:
        super().__init__()
        self._data_dir = data_dir
        self._disk_gib = disk_gib
        self._processes: list[subprocess.Popen[str]] = []
        self._folder: Path | None = None

    def start(self) -> LocalCephRGW:
        missing = [p for p in PROGRAMS if shutil.which(p) is None]
        if missing:
            raise ServerUnavailable(f"Ceph RGW is not installed ({', '.join(missing)} missing): {INSTALL}")
        if self._data_dir is None:
            self._folder = Path(tempfile.mkdtemp(prefix="ceph-rgw-"))
        else:
            self._folder = Path(self._data_dir)
            shutil.rmtree(self._folder, ignore_errors=True)
        try:
            self._start(self._folder)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, folder: Path) -> None:
        for sub in ("mon", "osd", "run", "log", "rgw"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        mon_v2, mon_v1, rgw_port = free_port(), free_port(), free_port()
        conf = folder / "ceph.conf"
        conf.write_text(_config(folder, mon_v2, mon_v1, rgw_port, self._disk_gib))
        c = ["-c", str(conf)]
        fsid = next(line.split(" = ")[1] for line in conf.read_text().splitlines() if line.startswith("fsid"))
        monmap, keyring = str(folder / "monmap"), str(folder / "keyring")
        self._run(
            [
                "monmaptool",
                "--create",
                "--fsid",
                fsid,
                "--addv",
                "a",
                f"[v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]",
                monmap,
            ]
        )
        self._run(
            [
                "ceph-authtool",
                "--create-keyring",
                keyring,
                "--gen-key",
                "-n",
                "mon.",
                "--cap",
                "mon",
                "allow *",
            ]
        )
        self._run(["ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", monmap, "--keyring", keyring])
        self._daemon(["ceph-mon", *c, "-f", "-i", "a"])
        osd_uuid = str(uuid.uuid4())
        osd_id = self._run(["ceph", *c, "--connect-timeout", "60", "osd", "new", osd_uuid]).strip()
        (folder / "osd" / f"osd.{osd_id}").mkdir()
        self._run(["ceph-osd", *c, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid])
        osd = self._daemon(["ceph-osd", *c, "-f", "-i", osd_id])
        deadline = time.monotonic() + 60
        while "1 up" not in self._run(["ceph", *c, "osd", "stat"]):
            if osd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ceph OSD did not come up; its log is in {folder / 'log'}")
            time.sleep(0.5)
        rgw = self._daemon(["radosgw", *c, "-f", "-n", "client.rgw.a"])
        self.endpoint_url = f"http://127.0.0.1:{rgw_port}"
        wait_for_http(self.endpoint_url, rgw, "radosgw", timeout=120)
        self._run(
            [
                "radosgw-admin",
                *c,
                "-n",
                "client.admin",
                "user",
                "create",
                "--uid=testing",
                "--display-name=testing",
                f"--access-key={ACCESS_KEY}",
                f"--secret-key={SECRET_KEY}",
            ]
        )

    def _run(self, command: list[str]) -> str:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command[:3])} … failed ({done.returncode}): {done.stderr.strip()[-500:]}"
            )
        return done.stdout

    def _daemon(self, command: list[str]) -> subprocess.Popen[str]:
        assert self._folder is not None
        log = open(self._folder / "log" / f"{command[0]}.out", "w")  # noqa: SIM115 - the child keeps it
        with log:
            process = subprocess.Popen(
                dying_with_parent(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        self._processes.append(process)
        return process

    def stop(self) -> None:
        # radosgw first, the monitor last: the others would wait for a monitor that is gone.
        for process in reversed(self._processes):
            stop_process(process)
        self._processes = []
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self._folder = None

    def server_pids(self) -> list[int]:
        return [p.pid for p in self._processes]
