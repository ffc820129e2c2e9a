"""What the emulator needs from the machine, installed on demand (CI machines start fresh).

- `ip` and `tc` (Debian: iproute2) for namespaces, veths, the bridge and HTB rate limits;
- `ping` (iputils-ping) to check the achieved RTTs;
- on kernels without `sch_netem`: `iptables` and the `NetfilterQueue` Python binding, which is
  built from source against Debian's libnetfilter-queue-dev (see delayer.py).

Installing needs root and apt-get; anything else is reported with the command that would fix it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys

logger = logging.getLogger(__name__)

COMMANDS = {"ip": "iproute2", "tc": "iproute2", "ping": "iputils-ping"}
NFQUEUE_COMMANDS = {"iptables": "iptables"}
NFQUEUE_BUILD_PACKAGES = ("libnetfilter-queue-dev", "gcc", "libc6-dev")
NFQUEUE_PIP = "NetfilterQueue>=1.1,<2"  # the maintained binding (github: oremanj/python-netfilterqueue)


class SetupError(RuntimeError):
    """The machine cannot run the emulator; the message says what is missing and how to get it."""


def is_root() -> bool:
    return os.geteuid() == 0


def _apt_install(packages: list[str]) -> None:
    if not packages:
        return
    if not is_root() or shutil.which("apt-get") is None:
        raise SetupError(
            f"missing system packages {' '.join(packages)}: install them "
            f"(as root: apt-get install -y {' '.join(packages)})"
        )
    logger.info("installing system packages: %s", " ".join(packages))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=300"]  # other jobs on the machine may be installing too
    update = subprocess.run(["apt-get", *lock, "update", "-qq"], env=env, capture_output=True, text=True)
    if update.returncode != 0:
        logger.warning("apt-get update failed (continuing with the old lists): %s", update.stderr[-500:])
    install = subprocess.run(
        ["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends", *packages],
        env=env,
        capture_output=True,
        text=True,
    )
    if install.returncode != 0:
        raise SetupError(f"apt-get install {' '.join(packages)} failed:\n{install.stderr[-2000:]}")


def ensure_commands(with_nfqueue: bool = False) -> None:
    """Install the Debian packages whose commands are missing."""
    wanted = dict(COMMANDS)
    if with_nfqueue:
        wanted.update(NFQUEUE_COMMANDS)
    missing = sorted({package for command, package in wanted.items() if shutil.which(command) is None})
    _apt_install(missing)
    still = [command for command in wanted if shutil.which(command) is None]
    if still:
        raise SetupError(f"commands still missing after installing: {', '.join(still)}")


def has_netfilterqueue(python: str = sys.executable) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("netfilterqueue") is not None
    return subprocess.run([python, "-c", "import netfilterqueue"], capture_output=True).returncode == 0


def ensure_netfilterqueue(python: str = sys.executable) -> None:
    """`import netfilterqueue` must work in `python` (the delayer's interpreter)."""
    if has_netfilterqueue(python):
        return
    missing_headers = not os.path.exists("/usr/include/libnetfilter_queue/libnetfilter_queue.h")
    _apt_install([p for p in NFQUEUE_BUILD_PACKAGES if missing_headers or shutil.which(p) is None])
    logger.info("building the NetfilterQueue binding into %s", python)
    result = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", NFQUEUE_PIP], capture_output=True, text=True
    )
    if result.returncode != 0 or not has_netfilterqueue(python):
        raise SetupError(f"could not install {NFQUEUE_PIP} into {python}:\n{result.stderr[-2000:]}")
    importlib.invalidate_caches()


def run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a network command; on failure the error names the command and its stderr."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise SetupError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def netns_works() -> str | None:
    """None if this process can create network namespaces; else why not (for skips and errors)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if not is_root():
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        with contextlib.suppress(SetupError):
            ensure_commands()
        if shutil.which("ip") is None:
            return "`ip` (iproute2) is missing and could not be installed"
    name = f"lsw-probe-{os.getpid()}"
    result = run(["ip", "netns", "add", name], check=False)
    if result.returncode != 0:
        return f"`ip netns add` fails here: {result.stderr.strip()}"
    run(["ip", "netns", "del", name], check=False)
    return None


def kernel_has_netem() -> bool:
    """Whether `tc ... netem` works (asked of the kernel in a throw-away namespace, which also
    lets it auto-load sch_netem where it is a module)."""
    name = f"lsw-probe-{os.getpid()}"
    if run(["ip", "netns", "add", name], check=False).returncode != 0:
        return False
    try:
        run(["ip", "-n", name, "link", "set", "lo", "up"], check=False)
        probe = run(
            ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False
        )
        return probe.returncode == 0
    finally:
        run(["ip", "netns", "del", name], check=False)


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot, from /proc/stat's `cpu` line: what the
    whole host did, the emulation's processes and anything else (the delayer, the kernel's packet
    work, other users)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How many of the host's cores were busy on average between two `host_cpu_ticks` readings."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return os.cpu_count() * busy / total if total > 0 else 0.0
