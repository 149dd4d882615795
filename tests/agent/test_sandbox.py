"""The python tool's sandbox (mrl/agent/sandbox.py) against hostile programs (issue 33): each tries
to reach the host, and each must be contained. The sandbox is called directly (run_sandboxed), as
the tool does; tests/agent/test_sandbox_tool.py goes through the tool runner."""
from __future__ import annotations

import os
import socket
import subprocess
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest

from mrl.agent import sandbox
from mrl.agent.builtin_tools import run_sandboxed, sandbox_problem

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox on this host: {sandbox_problem()}")


def run(code: str, timeout_s: float = 60.0, memory_mb: int = 256) -> tuple[int, str, str]:
    return run_sandboxed(textwrap.dedent(code), timeout_s, memory_mb=memory_mb)


def survivors(token: str) -> list[psutil.Process]:
    """Processes whose command line holds ``token`` (a sandboxed program's, forks included), after a
    generous wait for the kernel to finish killing a pid namespace."""
    def find() -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["cmdline"]):
            if token in " ".join(p.info["cmdline"] or ()):
                out.append(p)
        return out
    _, alive = psutil.wait_procs(find(), timeout=15)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def test_runs_as_nobody_without_capabilities() -> None:
    code, out, _ = run("""
        import os
        print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd())
        print([l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm'))])
        print(' '.join(open('/proc/self/uid_map').read().split()))
        print(os.getpid() > 1, len([p for p in os.listdir('/proc') if p.isdigit()]))
    """)
    uid, caps, uid_map, pids = out.splitlines()
    assert code == 0 and uid == "65534 65534 [] /tmp" and caps == "['0000000000000000', '0000000000000000']", out
    if os.geteuid() == 0:  # nobody inside is nobody on the host, not root
        assert "65534 65534 1" in uid_map, uid_map
    assert pids == "True 2", pids  # its own pid namespace: init and the program


def test_host_files_are_out_of_sight(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's key")
    checkout_file = REPO / "setup.py"
    assert checkout_file.is_file(), f"{checkout_file} is missing on the host: the probe would pass vacuously"
    code, out, err = run(f"""
        import os
        for path in [{str(secret)!r}, {str(checkout_file)!r}, '/etc/shadow', '/root/.bashrc', '/work']:
            try:
                open(path).read()
                print('READ', path)
            except OSError as e:
                print(type(e).__name__)
        print(sorted(os.listdir('/')))
    """)
    lines = out.splitlines()
    assert code == 0 and lines[:5] == ["FileNotFoundError"] * 5, out + err
    assert set(eval(lines[5])) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root", "sbin", "tmp", "usr", "opt", "home"}
    assert "work" not in lines[5] and "the user's key" not in out


def test_checkout_cannot_be_listed_written_or_deleted(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    code, out, err = run(f"""
        import os, shutil
        for act in (lambda: os.listdir({str(REPO)!r}), lambda: os.listdir({str(tmp_path)!r}),
                    lambda: os.remove({str(victim)!r}), lambda: shutil.rmtree({str(tmp_path)!r}),
                    lambda: open({str(tmp_path / 'new.txt')!r}, 'w'), lambda: open({str(REPO / 'x.txt')!r}, 'w'),
                    lambda: open('/usr/lib/x', 'w'), lambda: open('/x', 'w'), lambda: os.mkdir('/etc/x')):
            try:
                act()
                print('DONE')
            except OSError as e:
                print(type(e).__name__)
    """)
    assert code == 0 and "DONE" not in out and len(out.splitlines()) == 9, out + err
    assert victim.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["victim.txt"]
    assert not (REPO / "x.txt").exists()


def test_host_unix_sockets_and_loopback_tcp_are_unreachable(tmp_path: Path) -> None:
    listeners = []
    path_sock = socket.socket(socket.AF_UNIX)
    path_sock.bind(str(tmp_path / "host.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"\0mrl-test-{uuid.uuid4().hex}"
    abstract.bind(abstract_name)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    for s in (path_sock, abstract, tcp):
        s.listen(8)
        s.setblocking(False)
        listeners.append(s)
    try:
        code, out, err = run(f"""
            import socket
            for family, addr in ((socket.AF_UNIX, {str(tmp_path / 'host.sock')!r}), (socket.AF_UNIX, {abstract_name!r}),
                                 (socket.AF_INET, ('127.0.0.1', {tcp.getsockname()[1]}))):
                s = socket.socket(family)
                s.settimeout(5)
                try:
                    s.connect(addr)
                    print('CONNECTED')
                except OSError as e:
                    print(type(e).__name__)
        """)
        assert code == 0 and out.split() == ["FileNotFoundError", "ConnectionRefusedError", "OSError"], out + err
        for s in listeners:  # nothing reached the host's side either
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in listeners:
            s.close()


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing() -> None:
    token = f"bomb-{uuid.uuid4().hex}"
    code, out, err = run(f"""
        import os, time
        # {token}
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(600)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(n, type(e).__name__)
    """)
    n, why = out.split()
    assert code == 0 and why == "BlockingIOError" and 0 < int(n) < sandbox.MAX_PROCESSES, out + err
    assert survivors(token) == []


def test_a_recursive_fork_bomb_is_bounded_and_killed_at_the_timeout() -> None:
    token = f"bomb-{uuid.uuid4().hex}"
    with pytest.raises(subprocess.TimeoutExpired):
        run(f"""
            import os
            # {token}
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        """, timeout_s=3.0)
    assert survivors(token) == []


def test_detached_and_daemonised_children_die_with_the_call() -> None:
    token = f"daemon-{uuid.uuid4().hex}"
    code, out, err = run(f"""
        import os, subprocess, sys, time
        # {token}
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {token}'], start_new_session=True)
        if os.fork() == 0:  # the classic daemon: fork, setsid, fork, sleep
            os.setsid()
            if os.fork() == 0:
                time.sleep(600)
            os._exit(0)
        print('left them')
    """)
    assert code == 0 and out.strip() == "left them", out + err
    assert survivors(token) == []


def test_memory_output_and_disk_are_bounded() -> None:
    code, out, err = run("x = bytearray(2 << 30)", memory_mb=256)
    assert code == 1 and "MemoryError" in err
    code, out, err = run("import sys\nwhile True: sys.stdout.write('y' * 65536)")
    # RLIMIT_FSIZE at sandbox.MAX_FILE_MB of output (Python ignores SIGXFSZ: the write fails instead)
    assert code == 1 and "OSError: [Errno 27] File too large" in err, (code, err[-300:])
    assert 0 < len(out) <= 4 * 4000
    code, out, err = run("""
        import os
        written = 0
        try:
            for i in range(1000):
                with open(f'/tmp/f{i}', 'wb') as f:
                    f.write(b'z' * (8 << 20))
                written += 8
        except OSError as e:
            print(written, e.strerror)
    """)
    assert code == 0 and out.split(" ", 1)[1].strip() == "No space left on device", out + err
    assert int(out.split()[0]) < 64 + 8  # the private /tmp's size


def test_a_program_cannot_see_the_previous_calls_files() -> None:
    assert run("open('/tmp/mine', 'w').write('x'); print(len(open('/tmp/mine').read()))")[1] == "1\n"
    assert run("import os; print(os.listdir('/tmp'))")[1] == "[]\n"
