"""The ``python`` tool's sandbox: one program in namespaces of its own, on a minimal read-only root.

Run as ``python -I -S sandbox.py`` with a JSON request on stdin (``code``, ``cpu_s``, ``memory_mb``,
``tmp_mb``, ``error_fd``); the program's stdout/stderr are this process's, and so is its exit status
(128+N for a signal N). When the sandbox cannot be built, the reason goes to ``error_fd`` (apart
from the program's stderr, so a program cannot forge it) and the exit status is ``SETUP_FAILED``.
Standard library only and no mrl import: it is started per call and must start fast (docs/agent.md).

Four processes, because each step needs the one before it::

    launcher (host)  forks  setup: drops supplementary groups, unshares the user, mount, network,
                            pid, IPC and UTS namespaces; the launcher (still in the host's user
                            namespace) writes its uid/gid maps: uid 65534 inside is uid 65534 on
                            the host when mrl runs as root (the program is really ``nobody``; root
                            inside is root, for the setup), else the user's own uid (the only one
                            an unprivileged user may map)
      setup  forks  init: pid 1 of the new pid namespace; builds the root on a tmpfs (read-only
                    binds of /usr, /lib*, the Python install and two /etc files; /dev/null & co;
                    a fresh /proc; a private tmpfs /tmp), pivots into it and reaps
        init  forks  program: rlimits, uid/gid 65534, no_new_privs, exec ``python -I -c code``

When init exits (after the program) the kernel kills everything left in its pid namespace, so
detached and daemonised children end with the call; the namespaces' tmpfs mounts vanish with it.
Each process dies with its parent (PR_SET_PDEATHSIG), so killing the launcher ends the tree.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import stat
import sys

SETUP_FAILED = 125
_error_fd = 2  # the request's error_fd: why the sandbox could not be built; the program never holds it
UID = GID = 65534  # nobody / nogroup
#: the program's limits besides RLIMIT_AS (the request's memory_mb: agent.tool_memory_mb) and RLIMIT_CPU
MAX_PROCESSES = 64  # RLIMIT_NPROC: a fork bomb stops here
MAX_FILE_MB = 16  # RLIMIT_FSIZE: any file the program writes, its captured output included
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE
ROOT_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("null", "zero", "full", "random", "urandom")
PASSWD = "root:x:0:0:root:/:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/tmp:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(OSError):
    pass


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SandboxError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _ok(_libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {src} on {dst}")


def _prctl(option: int, arg: int) -> None:
    _ok(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _locked_flags(path: str) -> int:
    """The mount flags a read-only remount must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    out = MS_NOSUID | MS_NODEV | (f & (MS_NOEXEC | MS_NOATIME | MS_NODIRATIME))
    return out | (MS_RELATIME if f & 4096 else 0)  # ST_RELATIME is 4096, MS_RELATIME 1<<21


def _binds(python: str) -> list[str]:
    """Host paths to show read-only at the same path: the OS's /usr and /lib*, and the Python
    install (for a pyenv/conda interpreter, only its own prefix, not the home directory around it)."""
    prefix = os.path.realpath(sys.base_prefix)
    paths = [p for p in ROOT_DIRS if os.path.lexists(p)]
    for extra in (prefix, os.path.dirname(python)):
        if not any(extra == p or extra.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(extra)
        if extra == "/tmp" or extra.startswith("/tmp/"):  # it would sit under the program's private /tmp
            raise SandboxError(0, f"the Python install {extra} is under /tmp, which the sandbox replaces; "
                                  "use an interpreter installed elsewhere")
    return paths + [p for p in ETC_FILES if os.path.lexists(p)]


def _make_parents(path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)


def _build_root(python: str, tmp_mb: int) -> None:
    """In init (pid 1, new mount namespace): the new root on a tmpfs mounted over /tmp, then pivot."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Open the sources before the tmpfs hides /tmp (a source may live there); bind through /proc/self/fd.
    sources = [(p, os.open(p, os.O_PATH | os.O_NOFOLLOW)) for p in _binds(python)]
    root = "/tmp"
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, fd in sources:
        dst = root + path
        _make_parents(dst)
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):  # /lib -> usr/lib on merged-/usr systems, /etc/localtime
            os.symlink(os.readlink(path), dst)
            continue
        if stat.S_ISDIR(st.st_mode):
            os.makedirs(dst, mode=0o755, exist_ok=True)
        else:
            open(dst, "w").close()
        _mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(dst))
    for path, fd in sources:
        os.close(fd)
    for name, text in (("passwd", PASSWD), ("group", GROUP)):
        _make_parents(f"{root}/etc/{name}")
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    os.makedirs(f"{root}/dev", mode=0o755, exist_ok=True)
    for dev in DEVICES:
        open(f"{root}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    os.mkdir(f"{root}/proc", 0o555)
    _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(f"{root}/tmp", 0o755)
    _mount("tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={tmp_mb}m,mode=0700,uid={UID},gid={GID}")
    os.chdir(root)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is not None:  # the old root stacked under the new one, then detached: nothing of the host is left
        _ok(_libc.syscall(nr, b".", b"."), "pivot_root")
        _ok(_libc.umount2(b".", MNT_DETACH), "umount the old root")
    else:  # chroot: the program has no capability to leave it
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _program(python: str, code: str, cpu_s: int, memory_mb: int) -> None:
    """In the program's process (a child of init): limits, an unprivileged uid, exec."""
    import resource

    for lim, value in ((resource.RLIMIT_NPROC, MAX_PROCESSES), (resource.RLIMIT_CPU, cpu_s),
                       (resource.RLIMIT_AS, memory_mb << 20),
                       (resource.RLIMIT_FSIZE, MAX_FILE_MB << 20), (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(lim, (value, value))
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, _error_fd)  # all but the setup's error channel, which closes at exec
    os.closerange(_error_fd + 1, 1 << 16)
    os.set_inheritable(_error_fd, False)
    os.setresgid(GID, GID, GID)
    os.setresuid(UID, UID, UID)  # from root: every capability is cleared; exec drops the rest
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    os.chdir("/tmp")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    os.execve(python, [python, "-I", "-c", code], env)


def _status(st: int) -> int:
    code = os.waitstatus_to_exitcode(st)
    return 128 - code if code < 0 else code


def _die(msg: str) -> None:
    os.write(_error_fd, f"{msg}\n".encode())
    os._exit(SETUP_FAILED)


def _init(req: dict, alive_r: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:  # the setup died before that: nobody would stop us
        os._exit(SETUP_FAILED)
    os.close(alive_r)
    try:
        _build_root(req["python"], int(req["tmp_mb"]))
    except OSError as e:
        _die(f"could not build the root: {e}")
    pid = os.fork()
    if pid == 0:
        try:
            _program(req["python"], req["code"], int(req["cpu_s"]), int(req["memory_mb"]))
        except OSError as e:
            _die(f"could not start the program: {e}")
    while True:  # reap orphans until the program ends; then our exit ends the namespace
        got, st = os.wait()
        if got == pid:
            os._exit(_status(st))


def _setup(req: dict, parent: int, ready_w: int, go_r: int, as_root: bool) -> None:
    try:
        if as_root:
            os.setgroups([])  # root's supplementary groups would stay the program's
        _ok(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
            "unshare (user namespaces disabled on this host?)")
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(SETUP_FAILED)
    except OSError as e:
        _die(str(e))
    os.write(ready_w, b"1")
    if os.read(go_r, 1) != b"1":
        _die("the launcher could not write the uid/gid maps")
    alive_r, alive_w = os.pipe()  # at EOF once the setup is gone (init checks it after asking to die with it)
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _init(req, alive_r)
    os._exit(_status(os.waitpid(pid, 0)[1]))


def _maps_nobody() -> bool:
    """Whether this process may map uid/gid 65534 to itself: root with 65534 mapped in its namespace
    (on the host, always; under an outer user namespace, only when that one maps it)."""
    if os.geteuid() != 0:
        return False
    for name, want in (("uid_map", UID), ("gid_map", GID)):
        with open(f"/proc/self/{name}") as f:
            if not any(int(a) <= want < int(a) + int(n) for _, a, n in (line.split() for line in f if line.strip())):
                return False
    return True


def _write_maps(pid: int, as_root: bool) -> None:
    if as_root:  # root inside is root (the setup creates the root's files), nobody is nobody
        maps = {"uid_map": f"0 0 1\n{UID} {UID} 1\n", "gid_map": f"0 0 1\n{GID} {GID} 1\n"}
    else:  # an unprivileged user may map its own ids only, after denying setgroups
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        maps = {"uid_map": f"{UID} {os.geteuid()} 1\n", "gid_map": f"{GID} {os.getegid()} 1\n"}
    for name, text in maps.items():
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def main() -> int:
    global _error_fd
    req = json.loads(sys.stdin.read())
    _error_fd = int(req.get("error_fd", 2))
    req["python"] = os.path.realpath(req.get("python") or sys.executable)
    as_root = _maps_nobody()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        _setup(req, parent, ready_w, go_r, as_root)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) == b"1":
        try:
            _write_maps(pid, as_root)
            os.write(go_w, b"1")
        except OSError as e:
            os.write(_error_fd, f"could not write the uid/gid maps: {e}\n".encode())
    os.close(go_w)
    return _status(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    sys.exit(main())
