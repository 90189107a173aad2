"""Ray as the cluster engine: instances of a unit placed on Ray nodes by the unit's resources, and
started there by that node's zygote, so a cold start on another node costs what it costs locally.

Per node, a ``NodeAgent`` actor (pinned there, no resources of its own) runs the node's zygote
(``sits.runtime.zygote``, the same process a single host runs) with the deployed units preloaded.
Per instance, a placement group of one bundle asks Ray for the unit's CPUs, GPUs and memory; Ray
reserves them on a node that has them, and that node's agent forks the instance, which listens on
TCP (an address on the node's IP, a one-time token before any frame: the wire carries pickles). A
placement group, not an actor per instance: an actor would cost a new Ray worker process on the cold
path. The gateway connects to the instance as to a local one and speaks the same protocol, so the
router, autoscaler, failover and SLA guard work across nodes unchanged. The group holds the
resources for the instance's life. A zygote and its instances die with their agent
(``PR_SET_PDEATHSIG``), so a node that dies is an instance crash to the gateway: its streams
resume on another instance.

Nothing here is imported unless the gateway runs with ``--ray``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("sits.runtime")

NAMESPACE = "sits"
AGENT_PREFIX = "sits-node-"
FORK_TIMEOUT_S = 60.0       # an agent that does not fork by then is treated as a failed start
AGENT_CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Placement:
    """What one instance of a unit asks Ray for."""

    num_cpus: float
    num_gpus: float = 0.0
    memory: int = 0           # bytes

    @classmethod
    def of(cls, spec, footprint_bytes: int = 0) -> "Placement":
        """``device: cuda`` (or ``cuda:N``) asks for a GPU; ``auto`` and ``cpu`` run on the node's CPUs."""
        r = spec.resources
        return cls(num_cpus=float(r.cpu_quota or r.threads or 1), num_gpus=1.0 if r.device.startswith("cuda") else 0.0,
                   memory=int(footprint_bytes))

    def engine_config(self, cfg: dict) -> dict:
        """The instance's config on its node: as many threads as CPUs reserved (unless the unit set
        them), and the device its reservation gives it (the one GPU it sees is ``cuda``)."""
        out = dict(cfg)
        if out.get("threads") is None:
            out["threads"] = max(1, int(self.num_cpus))
        out["device"] = "cuda" if self.num_gpus else "cpu"
        return out

    def bundle(self) -> dict:
        out = {"CPU": self.num_cpus}
        if self.num_gpus:
            out["GPU"] = self.num_gpus
        if self.memory:
            out["memory"] = self.memory
        return out


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=10_000)
class NodeAgent:
    """One node's zygote, and the instances it forked (each waited for on the event loop, so live
    instances hold no threads or call slots beyond an awaiting coroutine)."""

    async def start(self) -> dict:
        from sits.runtime.zygote import DIE_WITH_PARENT, ZygoteClient
        self.ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == self.node_id)
        self.gpus = list(range(int(node.get("Resources", {}).get("GPU", 0))))
        self.gpus_of: dict[int, list[int]] = {}      # pid -> the GPU indexes it was given
        self.zygote = await ZygoteClient.start(env={**os.environ, DIE_WITH_PARENT: "1"})
        return {"node_id": self.node_id, "ip": self.ip, "pid": os.getpid(), "gpus": len(self.gpus),
                **self.zygote.info}

    def preload(self, cfg: dict) -> None:
        self.zygote.preload(cfg)

    async def fork(self, cfg: dict, token: str, num_gpus: float = 0.0) -> dict:
        """Fork an instance; with ``num_gpus``, on GPUs of this node no other instance of it holds (its
        placement group reserved that many here, so there are), and no GPU at all without."""
        taken = {g for gs in self.gpus_of.values() for g in gs}
        want = int(-(-num_gpus // 1)) if num_gpus else 0
        mine = [g for g in self.gpus if g not in taken][:want]
        if len(mine) < want:
            raise RuntimeError(f"node {self.node_id[:12]}: {want} GPU(s) reserved but only {len(mine)} free here")
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, mine))}
        pending = -id(env)                  # held across the await: another fork may pick GPUs meanwhile
        self.gpus_of[pending] = mine
        try:
            child = await self.zygote.fork(f"tcp://{self.ip}:0", cfg, token=token, env=env)
        finally:
            del self.gpus_of[pending]
        if mine:
            self.gpus_of[child.pid] = mine
        return {"pid": child.pid, "address": child.address, "node_id": self.node_id, "ip": self.ip, "gpus": mine}

    async def wait(self, pid: int) -> int | None:
        child = self.zygote.child(pid)
        try:
            return None if child is None else await child.wait_async()
        finally:
            self.gpus_of.pop(pid, None)

    def kill(self, pid: int) -> None:
        child = self.zygote.child(pid)
        if child is not None:
            child.kill()

    def signal(self, pid: int, sig: int) -> None:
        child = self.zygote.child(pid)
        if child is not None:
            child.send_signal(sig)

    async def shutdown(self) -> None:
        await self.zygote.shutdown()


async def _agent_on(node_id: str, timeout_s: float = 60.0):
    """The node's agent (the gateway starts one on every node it sees; a node that just joined may
    not have one yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(AGENT_PREFIX + node_id, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no SITS agent on Ray node {node_id[:12]}") from None
            await asyncio.sleep(0.1)


def _as_future(ref) -> asyncio.Future:
    return asyncio.wrap_future(ref.future())


async def _kill_late(agent, forking) -> None:
    try:
        info = await _as_future(forking)
        agent.kill.remote(info["pid"])
    except Exception:  # noqa: BLE001 - the fork failed after all: nothing to kill
        pass


def _remove(group) -> None:
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001 - already removed
        pass


class RayInstanceProcess:
    """An instance on a Ray node, handled like ``subprocess.Popen`` (poll, wait, kill) by the gateway;
    ``address`` and ``token`` are where and how it is reached."""

    def __init__(self, group, agent, info: dict, token: str):
        self.group, self.agent = group, agent
        self.pid: int = info["pid"]
        self.address: str = info["address"]
        self.node: str = info["ip"]
        self.node_id: str = info["node_id"]
        self.token = token
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._exit = agent.wait.remote(self.pid).future()
        self._exit.add_done_callback(self._exited)

    @staticmethod
    def _code(fut) -> int:
        try:
            code = fut.result()
        except Exception:  # noqa: BLE001 - the node (and its agent) is gone: so is the instance
            code = -1
        return -1 if code is None else code

    def _exited(self, fut) -> None:
        self.returncode = self._code(fut)
        # a node that died took its instance: Ray must not re-reserve the group elsewhere. Not from
        # here: this runs on Ray's own callback thread, where a call into Ray blocks for good
        threading.Thread(target=self._release, daemon=True).start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            self._exit.result(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"instance {self.pid} on {self.node}", timeout) from None
        except Exception:  # noqa: BLE001 - a dead node: _code says -1
            pass
        self.returncode = self._code(self._exit)
        self._release()
        return self.returncode

    def kill(self) -> None:
        try:
            self.agent.kill.remote(self.pid)
        except Exception:  # noqa: BLE001 - a dead node's agent: the instance died with it
            pass
        self._release()

    def send_signal(self, sig: int) -> None:
        self.agent.signal.remote(self.pid, sig)

    def _release(self) -> None:
        """Give the instance's resources back to Ray (once)."""
        with self._lock:
            group, self.group = self.group, None
        if group is not None:
            _remove(group)


class RayCluster:
    """The gateway's side: the connection to Ray, an agent per node, and the instance launcher."""

    def __init__(self, address: str | None, placement_timeout_s: float = 60.0):
        self.address = address
        self.placement_timeout_s = placement_timeout_s
        self.agents: dict[str, object] = {}       # node id -> its agent
        self.nodes: dict[str, dict] = {}          # node id -> what its agent reported
        self._preloads: list[dict] = []
        self._refreshed = 0.0
        self._refreshing: asyncio.Task | None = None

    async def start(self) -> None:
        """Connect (``auto``, an address, or None: a local one-node Ray) and start an agent on every node."""
        def init():
            if not ray.is_initialized():
                ray.init(address=self.address, namespace=NAMESPACE, include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
        await asyncio.to_thread(init)
        await self.refresh(force=True)

    def refresh_soon(self) -> None:
        """``refresh`` in the background (a node's zygote takes seconds to start: nothing waits for it)."""
        if (self._refreshing is None or self._refreshing.done()) and time.monotonic() - self._refreshed >= 5.0:
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_logged(), name="ray-refresh")

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except Exception:  # noqa: BLE001 - Ray unreachable for a moment: the next tick tries again
            log.exception("refreshing the Ray cluster's nodes failed")

    async def refresh(self, force: bool = False) -> None:
        """Start agents on nodes that joined; forget nodes that left (at most every few seconds)."""
        if not force and time.monotonic() - self._refreshed < 5.0:
            return
        self._refreshed = time.monotonic()
        alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")}
        for node_id in set(self.agents) - alive:
            self.agents.pop(node_id, None)
            self.nodes.pop(node_id, None)
            log.warning("Ray node %s left the cluster", node_id[:12])
        new = [n for n in alive if n not in self.agents]
        started = await asyncio.gather(*(self._start_agent(n) for n in new), return_exceptions=True)
        for node_id, res in zip(new, started):
            if isinstance(res, BaseException):
                log.error("no SITS agent on Ray node %s: %s", node_id[:12], res)

    async def _start_agent(self, node_id: str) -> None:
        agent = NodeAgent.options(name=AGENT_PREFIX + node_id, namespace=NAMESPACE, get_if_exists=True,
                                  scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        info = await agent.start.remote()
        for cfg in self._preloads:
            agent.preload.remote(cfg)
        self.agents[node_id] = agent
        self.nodes[node_id] = info
        log.info("Ray node %s (%s): zygote ready (pid %s)", node_id[:12], info["ip"], info["pid"])

    def preload(self, cfg: dict) -> None:
        """Every node's zygote builds this model now (and every node's that joins later)."""
        self._preloads.append(cfg)
        for agent in self.agents.values():
            agent.preload.remote(cfg)

    def forget(self, cfg: dict) -> None:
        """A unit undeployed: nodes that join later do not preload it."""
        if cfg in self._preloads:
            self._preloads.remove(cfg)

    def launcher(self, placement: Placement):
        """An instance launcher (``InstanceBackend.spawn``'s) that places by ``placement``."""
        async def launch(sock_path: str, cfg: dict) -> RayInstanceProcess:
            token = secrets.token_hex(16)
            group = placement_group([placement.bundle()])
            try:
                try:
                    await asyncio.wait_for(group.ready(), self.placement_timeout_s)
                except TimeoutError:
                    raise RuntimeError(f"no Ray node could place an instance needing {placement.bundle()} "
                                       f"within {self.placement_timeout_s:g} s") from None
                node_id = placement_group_table(group)["bundles_to_node_id"][0]
                agent = self.agents.get(node_id) or await _agent_on(node_id)
                forking = agent.fork.remote(placement.engine_config(cfg), token, placement.num_gpus)
                try:
                    info = await asyncio.wait_for(asyncio.shield(_as_future(forking)), FORK_TIMEOUT_S)
                except TimeoutError:      # a fork that lands later is killed: nobody will connect to it
                    asyncio.get_running_loop().create_task(_kill_late(agent, forking))
                    raise RuntimeError(f"the zygote on node {node_id[:12]} did not fork within "
                                       f"{FORK_TIMEOUT_S:g} s") from None
            except BaseException:
                _remove(group)
                raise
            return RayInstanceProcess(group, agent, info, token)
        launch.places = True
        return launch

    def view(self) -> list[dict]:
        return [{"node_id": n[:12], "ip": i["ip"], "zygote_pid": i["pid"]} for n, i in self.nodes.items()]

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        await asyncio.gather(*(asyncio.wait_for(a.shutdown.remote(), AGENT_CALL_TIMEOUT_S)
                               for a in self.agents.values()), return_exceptions=True)
        for agent in self.agents.values():
            try:
                ray.kill(agent)
            except Exception:  # noqa: BLE001
                pass
        self.agents.clear()
        await asyncio.to_thread(ray.shutdown)
