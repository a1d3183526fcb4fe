"""Run a shell command in a directory made to look like a container's filesystem, without a
container runtime: the tool sandbox (``sandbox.run_tool``: new user + network namespaces, no
network, CPU/memory/wall limits, the process group killed at the end) plus a mount namespace.

Inside, ``ROOT`` (a host directory) is ``/``: the command sees ``/app``, ``/tests``, ``/logs``
as ``ROOT/app``, ``ROOT/tests``, ``ROOT/logs``, so a Harbor task's absolute paths work as they
are and the engine reads what was written from ``ROOT`` afterwards. The host's system
directories (``/usr``, ``/bin``, ``/lib*``, ``/etc``, ``/opt``, ``/sbin``) are bound read-only
over ROOT's: the host's tools stand in for the task's image. ``/dev`` holds only null, zero,
random, urandom and tty; ``/proc`` is the host's where the kernel allows the bind. The command
runs as root of its user namespace (the engine's own user outside it).

Not a jail for hostile code (``chroot``, not ``pivot_root``: root of the namespace can climb
out of a chroot); a boundary for an agent's accidents, as the sandbox is for tools.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from headrace.tasks.sandbox import Limits, ToolResult, run_tool

SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")
DEVICES = ("null", "zero", "random", "urandom", "tty")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Runs inside the sandbox's child (already in its own user and network namespaces).
_ENTER = r"""
import ctypes, os
_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
def _mount(source, target, flags, fstype=None):
    if _libc.mount(source and source.encode(), target.encode(), fstype, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")
for name, line in (("setgroups", "deny"), ("uid_map", f"0 {OUTER_UID} 1"), ("gid_map", f"0 {OUTER_GID} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(line)
if _libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
_mount(None, "/", MS_REC | MS_PRIVATE)
for src, dst, writable in BINDS:
    target = ROOT + dst
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(src, target, MS_BIND | MS_REC)
    if not writable:
        _mount(None, target, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)
try:
    os.makedirs(ROOT + "/proc", exist_ok=True)
    _mount("/proc", ROOT + "/proc", MS_BIND | MS_REC)
except OSError:
    pass  # some kernels refuse it; most commands do without /proc
os.chroot(ROOT)
os.makedirs(WORKDIR, exist_ok=True)
os.chdir(WORKDIR)
os.execve("/bin/bash", ["bash", "-c", COMMAND], ENV)
"""


def binds(root: Path, read_only: tuple[str, ...] = ()) -> list[tuple[str, str, bool]]:
    """(host path, path inside, writable): the system dirs and ``read_only`` host dirs (bound at
    the same path, e.g. a virtual environment the task's tests use), the few devices."""
    out = []
    for name in SYSTEM_DIRS:
        host = Path("/", name)
        if host.is_symlink():  # /bin -> usr/bin on merged-/usr systems: the same link inside
            link = root / name
            if not link.is_symlink():
                link.symlink_to(os.readlink(host))
        elif host.is_dir():
            out.append((str(host), f"/{name}", False))
    out += [(str(Path(p).resolve()), str(Path(p).resolve()), False) for p in read_only]
    out += [(f"/dev/{d}", f"/dev/{d}", True) for d in DEVICES if Path("/dev", d).exists()]
    return out


def environment(extra: Mapping[str, str] = {}) -> dict[str, str]:
    base = {"PATH": PATH, "HOME": "/root", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb"}
    return base | {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")} | dict(extra)


async def run_in_root(
    command: str,
    root: Path,
    *,
    workdir: str = "/",
    env: Mapping[str, str] = {},
    limits: Limits | None = None,
    read_only: tuple[str, ...] = (),
) -> ToolResult:
    """``bash -c COMMAND`` with ``root`` as ``/``, in ``workdir`` (created if missing)."""
    root = root.resolve()
    for d in ("tmp", "root"):
        (root / d).mkdir(parents=True, exist_ok=True)
    program = (
        f"OUTER_UID, OUTER_GID = {os.geteuid()}, {os.getegid()}\nROOT = {str(root)!r}\n"
        f"BINDS = {binds(root, read_only)!r}\nWORKDIR = {workdir!r}\nCOMMAND = {command!r}\n"
        f"ENV = {environment(env)!r}\n{_ENTER}"
    )
    return await run_tool(program, limits or Limits(site_packages=False))
