"""Runs inside the sandbox's child process (``python -I _sandbox_child.py STATUS_FD NETWORK CPU_S
MEMORY_BYTES FILE_BYTES``): cut the network, set the limits, then run the program read from
stdin. Standard library only, and few imports: each costs start-up time on every tool call.

The network goes with a new user + network namespace: the new network namespace has only a
loopback that is down, and without capabilities in the parent's user namespace the code cannot
``setns`` back (as root, a network namespace alone could). What happened before the user's code
runs is reported on the status fd, which the code never sees, so it cannot forge a verdict.
"""

import io
import os
import resource
import socket
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
EXIT_MEMORY = 113
MEMORY_MARK = "[sandbox] memory limit exceeded"


def _isolate_network() -> str | None:
    """None when the process is in fresh user + network namespaces with no interface but ``lo``."""
    try:
        if hasattr(os, "unshare"):  # Python >= 3.12
            os.unshare(CLONE_NEWUSER | CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, os.strerror(errno))
    except (OSError, AttributeError) as e:
        return f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {e}"
    interfaces = [name for _, name in socket.if_nameindex()]
    return None if interfaces == ["lo"] else f"the new network namespace has interfaces {interfaces}"


def main() -> None:
    status_fd, network, cpu_s, memory_bytes, file_bytes = map(int, sys.argv[1:6])
    program = sys.stdin.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if not network and (problem := _isolate_network()) is not None:
        os.write(status_fd, f"unavailable: {problem}".encode())
        os._exit(1)
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu_s, cpu_s + 1)),  # SIGXCPU, then SIGKILL
        (resource.RLIMIT_AS, (memory_bytes, memory_bytes)),
        (resource.RLIMIT_FSIZE, (file_bytes, file_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)
    os.write(status_fd, b"ok")
    os.close(status_fd)
    sys.argv = ["<tool>"]
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):  # what a child process with pipes has
            stream.reconfigure(encoding="utf-8", errors="replace")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(program, "<tool>", "exec"), namespace)
    except MemoryError:
        namespace.clear()
        print(MEMORY_MARK, file=sys.stderr)
        raise SystemExit(EXIT_MEMORY) from None
    except SystemExit:
        raise
    except BaseException as e:  # the tool's own error, shown without this file's frame
        import traceback

        tb = e.__traceback__  # always set on a caught exception
        traceback.print_exception(type(e), e, tb.tb_next if tb else None)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
