"""Shared fixtures. Destructive tests (bombs, floods) use `contained`, which skips
unless a real sandbox proves the layers they rely on (pid namespace, cgroup limits)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sandbox  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak-long", action="store_true", help="long leak-audit mode")


def pytest_configure(config: pytest.Config) -> None:
    # The CLI passes its stdin on to the command, and every CLI a test starts without input
    # inherits ours: whatever the test runner left open there (a pipe a CI job never closes)
    # must not become a command's input. Tests that feed a command give it their own.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


@pytest.fixture(params=["native", "python"])
def child(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs twice: through the native stage and through the Python child."""
    monkeypatch.setenv("SANDBOXRUN_NATIVE", "1" if request.param == "native" else "0")
    return request.param


@pytest.fixture(scope="session")
def probe() -> sandbox.Result:
    """One real strict run: what this host really applies."""
    return sandbox.run(["/bin/true"])


@pytest.fixture(scope="session")
def isolated(probe: sandbox.Result) -> sandbox.Result:
    if probe.status != "ok":
        pytest.skip(f"strict sandbox unavailable here: {probe.error}")
    return probe


@pytest.fixture(scope="session")
def contained(isolated: sandbox.Result) -> sandbox.Result:
    """Guard for tests that would harm the host if the sandbox were broken."""
    iso = isolated.isolation
    if "pid" not in iso.namespaces or iso.cgroup == "none" or iso.limits.get("processes") is None:
        pytest.skip("destructive test needs a pid namespace and cgroup limits, not proven active")
    return isolated


@pytest.fixture
def private_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private sessions state directory; whatever a test left running is removed."""
    from sandbox import sessions
    from sandbox.errors import SandboxError

    d = tmp_path / "state"
    monkeypatch.setenv("SANDBOXRUN_STATE_DIR", str(d))
    monkeypatch.delenv("SANDBOXRUN_SESSION_TTL", raising=False)
    yield d
    if d.exists():
        for s in sessions.list_sessions(sweep=False):
            try:
                s.remove(grace=0)
            except SandboxError:
                pass


@contextlib.contextmanager
def _listener(address: str) -> Iterator[int]:
    """A TCP listener of the host's on `address` that answers b"host-secret"; yields its port."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((address, 0))
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                c.sendall(b"host-secret\n")
                c.close()
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join()
        srv.close()


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP listener on the host's 127.0.0.1; yields its port."""
    with _listener("127.0.0.1") as port:
        yield port


@pytest.fixture
def host_listener_everywhere() -> Iterator[int]:
    """A TCP listener on every address of the host (0.0.0.0); yields its port."""
    with _listener("0.0.0.0") as port:
        yield port


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


def marker() -> str:
    return f"sbxmark{os.getpid()}x{threading.get_ident() % 100000}x{os.urandom(3).hex()}"


@contextlib.contextmanager
def bystander(uid: int, gid: int | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A process of `uid` started outside any sandbox (a user's own shell, say), running once
    the block starts; killed, by pid, when it ends. A test asserts it was never signalled."""
    import shutil

    from sandbox import leaks

    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to start another user's process")
    own = marker()
    proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid if gid is None else gid}", "--clear-groups",
                             "bash", "-c", f"exec -a {own} sleep 1000"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not any(p.cmdline.startswith(own) for p in leaks.marked(own)) and time.monotonic() < deadline:
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()


# A run's command that ignores SIGTERM and leaves a daemon, tagged with MARK, ignoring it too.
STUBBORN = "trap '' TERM; (setsid bash -c \"trap '' TERM; exec -a {mark} sleep 1000\" > /dev/null 2>&1 &); sleep 30"


def end_marked(mark: str) -> None:
    """After a failed test: SIGKILL what it started and tagged with `mark`, by pid."""
    from sandbox import leaks

    for proc in leaks.marked(mark):
        os.kill(proc.pid, 9)


@contextlib.contextmanager
def inherited_at(number: int, fd: int) -> Iterator[None]:
    """A copy of `fd` at `number`, inheritable, as a caller of the library might leave one;
    whatever was at `number` before is put back afterwards."""
    try:
        saved = os.dup(number)
    except OSError:
        saved = -1
    os.dup2(fd, number, inheritable=True)
    try:
        yield
    finally:
        if saved >= 0:
            os.dup2(saved, number)
            os.close(saved)
        else:
            os.close(number)
