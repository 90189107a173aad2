"""A compute quota per instance process: a CPU share enforced by a Linux cgroup where the host
allows it, and a thread cap otherwise.

Instances of different units share one host; without a cap one busy unit's forward passes starve
the others' decode steps. A cgroup quota (CFS bandwidth: ``quota`` µs of CPU time per ``period``)
is enforced by the kernel whatever the instance does, so it is preferred; many hosts (containers
with a read-only or hybrid cgroup mount) cannot create groups, and there the instance is asked to
limit its own thread pools instead (``CpuQuota.threads``), which bounds parallelism, not time.

Layout: one parent group ``sits`` under the detected hierarchy root and one child
``sits-<name>`` per instance; the instance's pid is moved into the child. Three host shapes are
handled:

* cgroup v2 (``cpu.max`` = ``"QUOTA PERIOD"``), at ``/sys/fs/cgroup`` or, on a hybrid host, at
  ``/sys/fs/cgroup/unified`` when the ``cpu`` controller is bound there (it usually is not: on a
  hybrid host ``cpu`` belongs to v1). Children only get ``cpu.max`` once ``+cpu`` is in the
  parent's ``cgroup.subtree_control``, so it is enabled in the root's and in ``sits``'s.
* cgroup v1 ``cpu`` controller (``cpu.cfs_period_us`` / ``cpu.cfs_quota_us``).
* neither usable: mechanism ``"threads"``, with ``detail`` saying why.

Stdlib only, so the gateway can import it without the engine's dependencies.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import re
import time
from dataclasses import dataclass

log = logging.getLogger("sits.runtime")

PERIOD_US = 100_000          # CFS period; 100 ms is the kernel default and what cpu.max shows
MIN_QUOTA_US = 1_000         # the kernel rejects smaller quotas (EINVAL) in both v1 and v2
PARENT = "sits"              # the parent group under the hierarchy root
V2_DEFAULT = "/sys/fs/cgroup"
V2_HYBRID = "/sys/fs/cgroup/unified"
V1_DEFAULT = "/sys/fs/cgroup/cpu"

_RELEASE_TRIES = 10          # rmdir attempts per release() (a killed task leaves its group late)
_RELEASE_SLEEP_S = 0.05


@dataclass(frozen=True)
class CpuQuota:
    """What was applied to one instance, reported by ``sits status``."""

    cpus: float | None       # the share asked for (0.5 = half a core); None = unlimited
    mechanism: str           # "cgroup-v2" | "cgroup-v1" | "threads" | "none"
    threads: int | None      # thread cap the instance should use; set whenever cpus is
    cgroup: str | None       # the cgroup directory the pid was moved into, if any
    detail: str              # one human sentence, e.g. why cgroups were not used

    def to_dict(self) -> dict:
        """Plain JSON-able dict, for the status API."""
        return dataclasses.asdict(self)


def sanitize_name(name: str) -> str:
    """The group-name-safe form of an instance name: ``[a-z0-9._-]`` only, never empty, ``.`` or
    ``..`` (it becomes a directory name, so it must not escape or collide with control files)."""
    safe = re.sub(r"[^a-z0-9._-]+", "-", str(name).lower()).strip(".-")[:64].strip(".-")
    return safe or "unnamed"


def thread_cap(cpus: float) -> int:
    """Threads an instance limited to ``cpus`` cores should run: more would only time-slice."""
    return max(1, math.ceil(cpus))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _write(path: str, value: str) -> None:
    """Write one value to an existing control file. No O_CREAT: a missing file means the
    controller is not there, and that must fail rather than create a plain file."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)   # as `echo >` does; truncation is a no-op on cgroupfs
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _why(exc: OSError) -> str:
    """Short reason for an OSError, with the hint that matters for cgroups."""
    hint = {
        errno.EROFS: "the cgroup filesystem is mounted read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.ENOENT: "a control file is missing (controller not enabled here?)",
        errno.EBUSY: "the group is busy (cgroup v2 forbids enabling controllers in a group "
                     "that holds processes)",
        errno.ESRCH: "no such process",
        errno.EINVAL: "the kernel rejected the value",
        errno.EOPNOTSUPP: "operation not supported",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{hint}{where}"


def _controllers(root: str) -> set[str]:
    try:
        return set(_read(os.path.join(root, "cgroup.controllers")).split())
    except OSError:
        return set()


def _detect(root: str | None) -> tuple[str, str | None, str]:
    """(kind, root, reason): kind is "cgroup-v2", "cgroup-v1" or "threads"; reason says why
    when cgroups are not usable. Only looks; creates nothing."""
    if root is None:
        if os.path.isfile(os.path.join(V2_DEFAULT, "cgroup.controllers")):
            if "cpu" in _controllers(V2_DEFAULT) and os.access(V2_DEFAULT, os.W_OK):
                return "cgroup-v2", V2_DEFAULT, ""
        if "cpu" in _controllers(V2_HYBRID) and os.access(V2_HYBRID, os.W_OK):
            return "cgroup-v2", V2_HYBRID, ""
        if os.path.isfile(os.path.join(V1_DEFAULT, "cpu.cfs_quota_us")) and os.access(V1_DEFAULT, os.W_OK):
            return "cgroup-v1", V1_DEFAULT, ""
        return "threads", None, (f"no writable cgroup with the cpu controller was found (tried "
                                 f"{V2_DEFAULT}, {V2_HYBRID} and {V1_DEFAULT})")
    if not os.path.isdir(root):
        return "threads", None, f"cgroup root {root} does not exist"
    if os.path.isfile(os.path.join(root, "cgroup.controllers")):
        kind = "cgroup-v2"
        if "cpu" not in _controllers(root):
            return "threads", None, f"the cgroup v2 hierarchy at {root} has no cpu controller"
    elif os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
        kind = "cgroup-v1"
    else:
        return "threads", None, f"{root} is not a cgroup hierarchy with the cpu controller"
    if not os.access(root, os.W_OK):
        return "threads", None, f"cgroup root {root} is not writable"
    return kind, root, ""


class CpuQuotaManager:
    """Creates one child cgroup per instance under a SITS parent group, and removes it.

    Nothing is touched until ``mechanism`` or ``apply()`` is first used; then the parent group is
    created (and, for v2, ``+cpu`` delegated to it) once. If that fails, every instance gets the
    thread-cap fallback, with the reason in ``CpuQuota.detail``.
    """

    def __init__(self, root: str | None = None):
        """``root`` None autodetects the host's hierarchy; a path (a real mount, or a fake tree in
        tests) is used as the hierarchy root."""
        self._kind, self._root, self._reason = _detect(root)
        self._parent: str | None = None
        self._probed = False
        self._pending: set[str] = set()      # groups whose rmdir failed; retried on later calls

    # -- host capability --------------------------------------------------------------------
    @property
    def mechanism(self) -> str:
        """What ``apply()`` will use on this host: "cgroup-v2", "cgroup-v1" or "threads"."""
        self._ensure_parent()
        return self._kind

    @property
    def reason(self) -> str:
        """Why cgroups are not used ("" when they are)."""
        self._ensure_parent()
        return self._reason

    def group_path(self, name: str) -> str | None:
        """The directory an instance of this name gets, or None without cgroups."""
        if self.mechanism == "threads" or self._parent is None:
            return None
        return os.path.join(self._parent, f"sits-{sanitize_name(name)}")

    def _ensure_parent(self) -> None:
        """Create the ``sits`` parent group once; on failure switch to the thread fallback."""
        if self._probed:
            return
        self._probed = True
        if self._kind == "threads" or self._root is None:
            return
        parent = os.path.join(self._root, PARENT)
        try:
            if self._kind == "cgroup-v2":
                self._enable_cpu(self._root)
            os.makedirs(parent, exist_ok=True)
            if self._kind == "cgroup-v2":
                self._enable_cpu(parent)
        except OSError as exc:
            self._fallback(f"cannot set up the {PARENT} parent group under {self._root}: {_why(exc)}")
            return
        self._parent = parent

    @staticmethod
    def _enable_cpu(group: str) -> None:
        """Delegate the cpu controller to ``group``'s children (v2), unless it already is."""
        ctl = os.path.join(group, "cgroup.subtree_control")
        if "cpu" not in _read(ctl).split():
            _write(ctl, "+cpu")

    def _fallback(self, reason: str) -> None:
        log.warning("cpu quota: %s; falling back to thread caps", reason)
        self._kind, self._reason, self._parent = "threads", reason, None

    # -- per instance -----------------------------------------------------------------------
    def apply(self, pid: int, cpus: float | None, name: str) -> CpuQuota:
        """Limit ``pid`` to ``cpus`` cores in group ``sits-<name>``.

        Never raises for host limitations: any OSError gives a "threads" quota whose detail says
        why. Raises ValueError only for a non-positive (or non-finite) ``cpus``.
        """
        if cpus is not None:
            cpus = float(cpus)
            if not math.isfinite(cpus) or cpus <= 0:
                raise ValueError(f"cpus must be a positive number of cores, got {cpus!r}")
        self._reap_pending()
        if cpus is None:
            return CpuQuota(None, "none", None, None, "no CPU limit was asked for")
        threads = thread_cap(cpus)
        mech = self.mechanism
        if mech == "threads":
            return CpuQuota(cpus, "threads", threads, None,
                            f"{self._reason}, so the instance is capped at {threads} thread(s) instead")
        group = self.group_path(name)
        assert group is not None
        quota_us = max(MIN_QUOTA_US, round(cpus * PERIOD_US))
        try:
            os.makedirs(group, exist_ok=True)
            if mech == "cgroup-v2":
                _write(os.path.join(group, "cpu.max"), f"{quota_us} {PERIOD_US}")
            else:
                _write(os.path.join(group, "cpu.cfs_period_us"), str(PERIOD_US))
                _write(os.path.join(group, "cpu.cfs_quota_us"), str(quota_us))
            _write(os.path.join(group, "cgroup.procs"), str(int(pid)))
        except OSError as exc:
            why = _why(exc)
            log.warning("cpu quota for %s (pid %s) via %s failed: %s; using a thread cap", name, pid, mech, why)
            self._rmdir(group)
            return CpuQuota(cpus, "threads", threads, None,
                            f"the {mech} quota could not be applied ({why}), so the instance is capped "
                            f"at {threads} thread(s) instead")
        self._pending.discard(group)
        clamp = f" (raised to the kernel minimum of {MIN_QUOTA_US} us)" if quota_us != round(cpus * PERIOD_US) else ""
        log.info("cpu quota: pid %s limited to %.3g cpus in %s (%s)", pid, cpus, group, mech)
        return CpuQuota(cpus, mech, threads, group,
                        f"limited to {quota_us} us of CPU per {PERIOD_US} us period via {mech}{clamp}")

    def release(self, name: str, tries: int | None = None) -> None:
        """Remove the instance's group once it is empty. Moves nothing: the instance is expected
        to have exited; if it still holds processes the group is kept and retried quietly on
        later calls (``reap``). Never raises. ``tries=1`` never sleeps (for an event loop)."""
        try:
            group = self.group_path(name)
        except Exception:       # noqa: BLE001 -- release is cleanup, it must not fail
            return
        if group is None:
            return
        self._pending.add(group)
        tries = _RELEASE_TRIES if tries is None else max(1, tries)
        for attempt in range(tries):
            if self._rmdir(group):
                self._pending.discard(group)
                break
            if attempt + 1 < tries:
                time.sleep(_RELEASE_SLEEP_S)
        self._reap_pending()

    def reap(self) -> None:
        """Retry removing groups that still held processes (cheap: one rmdir each)."""
        self._reap_pending()

    def _reap_pending(self) -> None:
        for group in list(self._pending):
            if self._rmdir(group):
                self._pending.discard(group)

    @staticmethod
    def _rmdir(group: str) -> bool:
        """rmdir ``group``; True when it is gone. A group with processes in it answers EBUSY."""
        try:
            os.rmdir(group)
            log.debug("cpu quota: removed %s", group)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.debug("cpu quota: %s not removed yet: %s", group, _why(exc))
            return False
