"""Throwaway Apache Cassandra 5.0 nodes and clusters for tests, demos and benchmarks.

A lab tool, not part of the runtime packages: it launches JVMs. Cassandra
itself is fetched once from Maven Central (``org.apache.cassandra:cassandra-all``
and its runtime dependencies, with ``mvn``) into a cache folder
(``$DATAFERRY_CACHE``, else ``~/.cache/dataferry``) and run with the installed
``java`` (17, with the JPMS flags of Cassandra's own ``jvm17-server.options``).

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import fcntl
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

__all__ = ["DevCassandra", "DevCluster", "DevNode", "CASSANDRA_VERSION", "cassandra_classpath"]

#: the Cassandra the tests and benchmarks run (``DevCluster(version=...)`` takes another 5.0.x; 4.1 does
#: not start on Java 17: its jamm 0.3 cannot measure JDK 17's hidden classes)
CASSANDRA_VERSION = "5.0.9"

_MAIN_CLASS = "org.apache.cassandra.service.CassandraDaemon"

#: Cassandra 5.0's conf/jvm17-server.options (GC and JPMS); heap sizes are per node
_JVM17 = """
-XX:+UseG1GC -XX:+ParallelRefProcEnabled -XX:MaxTenuringThreshold=1 -XX:G1HeapRegionSize=16m
-XX:G1RSetUpdatingPauseTimePercent=5 -XX:MaxGCPauseMillis=300 -XX:InitiatingHeapOccupancyPercent=70
-Djdk.attach.allowAttachSelf=true
--add-exports=java.base/jdk.internal.misc=ALL-UNNAMED
--add-exports=java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED
--add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED --add-exports=java.rmi/sun.rmi.server=ALL-UNNAMED
--add-exports=java.sql/java.sql=ALL-UNNAMED --add-exports=java.base/java.lang.ref=ALL-UNNAMED
--add-exports=jdk.unsupported/sun.misc=ALL-UNNAMED
--add-exports=jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED
--add-exports=jdk.attach/sun.tools.attach=ALL-UNNAMED
--add-opens=java.base/java.lang.module=ALL-UNNAMED --add-opens=java.base/jdk.internal.loader=ALL-UNNAMED
--add-opens=java.base/jdk.internal.ref=ALL-UNNAMED --add-opens=java.base/jdk.internal.reflect=ALL-UNNAMED
--add-opens=java.base/jdk.internal.math=ALL-UNNAMED --add-opens=java.base/jdk.internal.module=ALL-UNNAMED
--add-opens=java.base/jdk.internal.util.jar=ALL-UNNAMED
--add-opens=jdk.management/com.sun.management.internal=ALL-UNNAMED
--add-opens=java.base/sun.nio.ch=ALL-UNNAMED --add-opens=java.base/java.io=ALL-UNNAMED
--add-opens=java.base/java.lang.reflect=ALL-UNNAMED --add-opens=jdk.compiler/com.sun.tools.javac=ALL-UNNAMED
--add-opens=java.base/java.lang=ALL-UNNAMED --add-opens=java.base/java.util=ALL-UNNAMED
-Dio.netty.tryReflectionSetAccessible=true -Dio.netty.allocator.useCacheForAllThreads=true
-Dio.netty.allocator.maxOrder=11
-XX:+ExitOnOutOfMemoryError
""".split()

#: start-up shortcuts for a throwaway cluster (no data to wait for)
_FAST_START = ["-Dcassandra.skip_wait_for_gossip_to_settle=0", "-Dcassandra.superuser_setup_delay_ms=0"]

_LOGBACK = """<configuration>
  <appender name="F" class="ch.qos.logback.core.FileAppender">
    <file>{log}</file>
    <encoder><pattern>%-5level [%thread] %date{{ISO8601}} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="F"/></root>
</configuration>
"""

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dataferry.dev</groupId><artifactId>cassandra-fetch</artifactId><version>1</version>
  <dependencies>
    <dependency>
      <groupId>org.apache.cassandra</groupId><artifactId>cassandra-all</artifactId><version>{version}</version>
    </dependency>
  </dependencies>
</project>
"""

_PASSWORD = "dataferry-dev"  # the throwaway keystore's; never a user's


# --- fetching Cassandra ----------------------------------------------------------------
def _cache_dir() -> Path:
    root = os.environ.get("DATAFERRY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dataferry")
    return Path(root)


def cassandra_classpath(version: str = CASSANDRA_VERSION) -> str:
    """The classpath of Cassandra ``version``: fetched from Maven Central on first use, then cached.

    Raise StoreUnavailable naming what is missing (``mvn``, the network) with
    Maven's own last lines.
    """
    lib = _cache_dir() / f"cassandra-{version}" / "lib"
    marker = lib / ".complete"
    if not marker.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with open(lib.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch at a time, across processes
            if not marker.is_file():
                _fetch(version, lib)
    return f"{lib}/*"


def _fetch(version: str, lib: Path) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StoreUnavailable(
            f"cannot fetch Apache Cassandra {version} for the development server: no 'mvn' on PATH; "
            "install Maven, e.g. apt-get install maven"
        )
    shutil.rmtree(lib, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="dataferry-mvn-") as tmp:
        Path(tmp, "pom.xml").write_text(_POM.format(version=version))
        cmd = [mvn, "-q", "-B", "dependency:copy-dependencies", f"-DoutputDirectory={lib}", "-DincludeScope=runtime"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1800)
    jar = lib / f"cassandra-all-{version}.jar"
    if proc.returncode != 0 or not jar.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise StoreUnavailable(
            f"fetching org.apache.cassandra:cassandra-all:{version} from Maven Central failed "
            f"(mvn exit {proc.returncode})\n{tail}"
        )
    (lib / ".complete").write_text(version)


# --- helpers -----------------------------------------------------------------------------
def _free_ports(n: int, hosts: tuple[str, ...] = ("127.0.0.1",)) -> list[int]:
    """``n`` distinct ports free on every one of ``hosts`` (each bound on all of them at once, then released)."""
    out: list[int] = []
    for _ in range(200):
        if len(out) == n:
            return out
        first = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        socks = [first]
        try:
            first.bind((hosts[0], 0))
            port = first.getsockname()[1]
            ok = port not in out
            for host in hosts[1:]:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                try:
                    s.bind((host, port))
                except OSError:
                    ok = False
                    break
            if ok:
                out.append(port)
        finally:
            for s in socks:
                s.close()
    raise StoreUnavailable(f"no {n} free ports on all of {', '.join(hosts)}")


def _tokens(nodes: int, per_node: int) -> list[list[int]]:
    """Murmur3 tokens: ``nodes * per_node`` evenly spaced over the ring, dealt round robin."""
    total = nodes * per_node
    step = (2**64) // total
    ring = [-(2**63) + k * step for k in range(total)]
    return [ring[i::nodes] for i in range(nodes)]


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise StoreUnavailable(
            "cannot start the development Cassandra: no 'java' on PATH; "
            "install a JRE 17, e.g. apt-get install openjdk-17-jre-headless"
        )
    return java


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _end(*procs: subprocess.Popen) -> None:
    """SIGCONT (a frozen JVM ignores SIGTERM), SIGTERM, then SIGKILL the process groups of
    ``procs``, all at once: each JVM drains for seconds, and one after another a 3-node
    cluster's stop took 20 s of the test suite."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGCONT)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            _signal_group(p.pid, sig)
        deadline = time.monotonic() + 10.0
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        live = [p for p in live if p.poll() is None]
        if not live:
            return


def _cleanup(procs: list, workdir: Path | None) -> None:
    _end(*procs)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


class DevNode:
    """One Cassandra JVM of a :class:`DevCluster`. Made by the cluster; its data stays across
    :meth:`kill` and :meth:`start`."""

    def __init__(self, cluster: DevCluster, index: int, address: str, tokens: list[int]) -> None:
        self.cluster = cluster
        self.index = index
        self.address = address
        self.tokens = tokens
        self.proc: subprocess.Popen | None = None
        self.frozen = False

    # --- files -----------------------------------------------------------------------
    @property
    def workdir(self) -> Path:
        assert self.cluster.workdir is not None, "the cluster has not started"
        return self.cluster.workdir / f"node{self.index + 1}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "cassandra.log"

    @property
    def pid(self) -> int | None:
        """The JVM's process id (also its process group), or None when not running."""
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _write_config(self) -> Path:
        c, d = self.cluster, self.workdir
        d.mkdir(parents=True, exist_ok=True)
        lines = [
            f"cluster_name: {c.name}",
            f"num_tokens: {len(self.tokens)}",
            f"initial_token: {','.join(map(str, self.tokens))}",
            "partitioner: org.apache.cassandra.dht.Murmur3Partitioner",
            "auto_bootstrap: false",
            f"data_file_directories: [{d / 'data'}]",
            f"commitlog_directory: {d / 'commitlog'}",
            f"saved_caches_directory: {d / 'saved_caches'}",
            f"hints_directory: {d / 'hints'}",
            f"cdc_raw_directory: {d / 'cdc_raw'}",
            "commitlog_sync: periodic",
            "commitlog_sync_period: 10000ms",
            "seed_provider:",
            "  - class_name: org.apache.cassandra.locator.SimpleSeedProvider",
            "    parameters:",
            f'      - seeds: "{c.nodes[0].address}:{c.storage_port}"',
            f"listen_address: {self.address}",
            f"rpc_address: {self.address}",
            f"storage_port: {c.storage_port}",
            f"native_transport_port: {c.port}",
            "start_native_transport: true",
            "endpoint_snitch: SimpleSnitch",
            "concurrent_compactors: 1",
            f"hinted_handoff_enabled: {'true' if c.hints else 'false'}",
            # a small heap: the default caps follow it, and a test's samples are up to a few MB
            "native_transport_max_frame_size: 32MiB",
        ]
        if c.auth:
            lines += ["authenticator: PasswordAuthenticator", "authorizer: CassandraAuthorizer",
                      "role_manager: CassandraRoleManager"]
        if c.tls:
            lines += [
                "client_encryption_options:",
                "  enabled: true",
                "  optional: true",  # plain and TLS on the same port
                f"  keystore: {c.keystore_path}",
                f"  keystore_password: {_PASSWORD}",
                "  store_type: PKCS12",
                "  require_client_auth: false",
            ]
        path = d / "cassandra.yaml"
        path.write_text("\n".join(lines) + "\n")
        (d / "logback.xml").write_text(_LOGBACK.format(log=self.log_path))
        return path

    # --- lifetime --------------------------------------------------------------------
    def launch(self) -> None:
        """Start the JVM (its data is kept from a previous run); :meth:`wait_ready` waits for it."""
        if self.running:
            return
        java, classpath = _java(), cassandra_classpath(self.cluster.version)
        config = self._write_config()
        cmd = [
            java, f"-Xms{self.cluster.heap}", f"-Xmx{self.cluster.heap}", "-Xss512k", *_JVM17, *_FAST_START,
            f"-Dcassandra.config=file://{config}",
            f"-Dlogback.configurationFile={self.workdir / 'logback.xml'}",
            f"-Dcassandra.storagedir={self.workdir}",
            f"-Dcassandra.logdir={self.workdir}",
            "-Dcassandra-foreground=yes",
            "-cp", classpath, _MAIN_CLASS,
        ]
        with open(self.workdir / "stdout.log", "ab") as out:
            # its own process group, so that signals reach every process the JVM starts
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.frozen = False
        self.cluster._track(self.proc)

    def start(self, *, timeout: float | None = None) -> DevNode:
        """Start this node (again) and wait until it answers CQL queries."""
        self.launch()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.cluster.startup_timeout)
        last: Exception | None = None
        while time.monotonic() < deadline:
            if not self.running:
                code = None if self.proc is None else self.proc.returncode
                raise StoreUnavailable(
                    f"development Cassandra node {self.address} exited with code {code} during startup\n"
                    f"{self.log_tail()}"
                )
            if self._port_open():
                try:
                    _query(self.address, self.cluster.port, "SELECT release_version FROM system.local",
                           self.cluster)
                    return
                except Exception as exc:  # noqa: BLE001 - not ready yet: keep waiting
                    last = exc
            time.sleep(0.2)
        raise StoreUnavailable(
            f"development Cassandra node {self.address}:{self.cluster.port} not ready after "
            f"{timeout or self.cluster.startup_timeout:.0f} s (last error: {last})\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the node, as a crash would; its data stays for :meth:`start`."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGKILL)
        _signal_group(self.proc.pid, signal.SIGCONT)
        self.proc.wait(30)
        self.proc, self.frozen = None, False

    def stop(self) -> None:
        """Stop the node cleanly (SIGTERM: Cassandra drains and flushes); its data stays."""
        if self.proc is None:
            return
        _end(self.proc)
        self.proc, self.frozen = None, False

    def freeze(self) -> None:
        """SIGSTOP the node: its sockets stay open and nothing answers (a hung JVM, a long GC)."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        """SIGCONT a frozen node."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGCONT)
            self.frozen = False

    def _port_open(self) -> bool:
        try:
            with socket.create_connection((self.address, self.cluster.port), timeout=0.5):
                return True
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        """The end of the node's log (and stdout), for error messages."""
        out = []
        for name in ("cassandra.log", "stdout.log"):
            path = self.workdir / name if self.cluster.workdir else None
            if path is not None and path.is_file():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                if tail:
                    out.append(f"--- {path} ---\n" + "\n".join(tail))
        return "\n".join(out) or "(no log written)"

    def __repr__(self) -> str:
        state = "frozen" if self.frozen else ("up" if self.running else "down")
        return f"DevNode({self.address}, {state})"


class DevCluster:
    """``nodes`` Cassandra 5.0 JVMs on ``127.0.0.1`` .. ``127.0.0.<nodes>``; a context manager.

    ``workdir`` holds each node's data, config and log; None makes a temporary
    folder that :meth:`stop` removes. ``port``: the CQL port of every node
    (None picks one free on all their addresses). ``auth`` turns on
    PasswordAuthenticator (user ``cassandra``, password ``cassandra``).
    ``hints=False`` turns hinted handoff off: a node back from an outage then
    misses the writes it was down for until a read repairs them (a test's worst
    case, made certain).
    """

    def __init__(
        self,
        nodes: int = 1,
        workdir: str | None = None,
        *,
        port: int | None = None,
        heap: str = "512M",
        num_tokens: int = 16,
        tls: bool = False,
        auth: bool = False,
        hints: bool = True,
        version: str = CASSANDRA_VERSION,
        startup_timeout: float = 120.0,
        first_address: int = 1,
    ) -> None:
        if not 1 <= nodes <= 9:
            raise ConfigError(f"a development cluster has 1 to 9 nodes, not {nodes}")
        self.name = f"dataferry-dev-{os.getpid()}"
        self.version, self.heap, self.tls, self.auth, self.hints = version, heap, tls, auth, hints
        self.startup_timeout = startup_timeout
        self._workdir_arg, self._port_arg = workdir, port
        self.workdir: Path | None = None
        self._owns_workdir = False
        self.port = port or 0
        self.storage_port = 0
        self.nodes = [DevNode(self, i, f"127.0.0.{first_address + i}", t)
                      for i, t in enumerate(_tokens(nodes, num_tokens))]
        self._procs: list = []
        self._finalizer: weakref.finalize | None = None

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(n.address for n in self.nodes)

    @property
    def host(self) -> str:
        return self.nodes[0].address

    @property
    def pid(self) -> int | None:
        """The first node's JVM process id."""
        return self.nodes[0].pid

    @property
    def keystore_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "keystore.p12"

    @property
    def ca_path(self) -> Path:
        """The PEM of the nodes' self-signed certificate (``tls=True``): the client's ``tls_ca``."""
        assert self.workdir is not None
        return self.workdir / "node-cert.pem"

    def _track(self, proc: subprocess.Popen) -> None:
        self._procs.append(proc)

    def start(self) -> DevCluster:
        """Start every node at once; return when each answers CQL and knows the others."""
        if self.workdir is not None and all(n.running for n in self.nodes):
            return self
        if self.workdir is None:
            if self._workdir_arg is None:
                self.workdir = Path(tempfile.mkdtemp(prefix="dataferry-cassandra-"))
                self._owns_workdir = True
            else:
                self.workdir = Path(self._workdir_arg)
                self.workdir.mkdir(parents=True, exist_ok=True)
            self._finalizer = weakref.finalize(self, _cleanup, self._procs,
                                               self.workdir if self._owns_workdir else None)
        if not self.storage_port:
            ports = _free_ports(2, self.hosts)
            self.port = self._port_arg or ports[0]
            self.storage_port = ports[1]
        _java()
        cassandra_classpath(self.version)  # fetched before any JVM starts
        if self.tls and not self.keystore_path.is_file():
            self._make_keystore()
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready()
            self._wait_ring()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ring(self) -> None:
        """Until every node lists the others in ``system.peers`` (they have gossiped)."""
        if len(self.nodes) == 1:
            return
        deadline = time.monotonic() + self.startup_timeout
        want = len(self.nodes) - 1
        while True:
            seen = []
            for node in self.nodes:
                try:
                    rows = _query(node.address, self.port, "SELECT peer FROM system.peers", self)
                    seen.append(len(rows))
                except Exception:  # noqa: BLE001
                    seen.append(-1)
            if all(s == want for s in seen):
                return
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"development cluster: nodes see {seen} peers, not {want} each, after "
                                       f"{self.startup_timeout:.0f} s\n{self.nodes[0].log_tail()}")
            time.sleep(0.5)

    def _make_keystore(self) -> None:
        keytool = shutil.which("keytool") or str(Path(os.path.realpath(_java())).parent / "keytool")
        san = ",".join(f"ip:{a}" for a in self.hosts) + ",dns:localhost"
        subprocess.run(
            [keytool, "-genkeypair", "-alias", "node", "-keyalg", "RSA", "-keysize", "2048", "-validity", "30",
             "-dname", "CN=dataferry-dev", "-ext", f"SAN={san}", "-keystore", str(self.keystore_path),
             "-storetype", "PKCS12", "-storepass", _PASSWORD, "-keypass", _PASSWORD],
            check=True, capture_output=True)
        subprocess.run(
            [keytool, "-exportcert", "-rfc", "-alias", "node", "-keystore", str(self.keystore_path),
             "-storepass", _PASSWORD, "-file", str(self.ca_path)],
            check=True, capture_output=True)

    def stop(self) -> None:
        """End every node (SIGTERM, then SIGKILL); remove a temporary workdir. Safe to call twice."""
        for node in self.nodes:
            node.proc, node.frozen = None, False
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._procs.clear()
        if self._owns_workdir:
            self.workdir = None
            self._owns_workdir = False

    def __enter__(self) -> DevCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, keyspace: str = "dataferry", **options) -> str:
        """A store URL naming every node, e.g. ``cassandra://127.0.0.1,127.0.0.2:PORT/ks?opt=v``."""
        if not self.port:
            raise ConfigError("DevCluster.url() needs a port: call start() first or pass port=")
        query = f"?{urlencode(options)}" if options else ""
        return f"cassandra://{','.join(self.hosts)}:{self.port}/{keyspace}{query}"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(n.log_tail(lines) for n in self.nodes)

    def __repr__(self) -> str:
        return f"DevCluster({self.version}, port={self.port}, {self.nodes})"


class DevCassandra(DevCluster):
    """One Cassandra 5.0 node on ``127.0.0.1`` (a :class:`DevCluster` of one); a context manager.

    :meth:`kill` and :meth:`start` bring the same node back on the same port, its data kept.
    """

    def __init__(self, workdir: str | None = None, *, port: int | None = None, heap: str = "512M",
                 startup_timeout: float = 120.0, tls: bool = False, auth: bool = False) -> None:
        super().__init__(1, workdir, port=port, heap=heap, startup_timeout=startup_timeout, tls=tls, auth=auth)

    def start(self) -> DevCassandra:
        if self.workdir is not None and not self.nodes[0].running and self.storage_port:
            self.nodes[0].start()  # again, after kill()
            return self
        super().start()
        return self

    def kill(self) -> None:
        """SIGKILL the node, as a crash would, keeping its data and port for :meth:`start`."""
        self.nodes[0].kill()

    def log_tail(self, lines: int = 30) -> str:
        return self.nodes[0].log_tail(lines)


def _query(host: str, port: int, cql: str, cluster: DevCluster | None = None) -> list:
    """Run ``cql`` on one node (protocol v4, consistency ONE); its rows."""
    from cassandra import ConsistencyLevel
    from cassandra.auth import PlainTextAuthProvider
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import WhiteListRoundRobinPolicy

    profile = ExecutionProfile(load_balancing_policy=WhiteListRoundRobinPolicy([host]),
                               consistency_level=ConsistencyLevel.ONE, request_timeout=5)
    auth = PlainTextAuthProvider("cassandra", "cassandra") if cluster is not None and cluster.auth else None
    driver = Cluster([host], port=port, protocol_version=4, execution_profiles={EXEC_PROFILE_DEFAULT: profile},
                     connect_timeout=2, schema_metadata_enabled=False, token_metadata_enabled=False,
                     auth_provider=auth)
    try:
        return list(driver.connect().execute(cql))
    finally:
        driver.shutdown()


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataferry.bench._devcassandra", description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--workdir")
    ap.add_argument("--port", type=int)
    ap.add_argument("--heap", default="512M")
    ap.add_argument("--tls", action="store_true")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # SIGTERM stops the nodes too, as Ctrl-C does
    with DevCluster(args.nodes, args.workdir, port=args.port, heap=args.heap, tls=args.tls) as cluster:
        print(f"Cassandra {cluster.version} up: {cluster.url('dataferry')}  (Ctrl-C stops it)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
