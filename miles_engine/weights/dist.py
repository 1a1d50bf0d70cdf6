"""A torch.distributed process group for weight sync, built *beside* the default group.

Trainer rank 0 owns a ``TCPStore`` (port 0 picks a free one); engine processes join as ranks
``1..world_size-1``. The group is constructed directly (``ProcessGroupGloo`` /
``ProcessGroupNCCL`` over the key layout SGLang's own groups use: :func:`group_store`), so it
never touches ``init_process_group``: the
trainer's own FSDP group and an engine's internals stay untouched. Gloo on CPU (loopback
device when the master address is a loopback address), NCCL on GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"unknown process-group backend {backend!r}; allowed: auto, {', '.join(BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which this process does not have; use 'gloo'")
    return backend


def comm_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def master_store(master_address: str, world_size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """The rank-0 store, listening on ``master_address`` only; returns at once (workers connect
    later). ``store.port`` is the bound port.

    A ``TCPStore`` told a host still listens on every interface (``::``); this one is handed a
    socket already bound to the address (``master_listen_fd``), so a loopback group stays on
    loopback and a cluster's group on the node's own address."""
    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((master_address, port))
        sock.listen(1024)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(master_address, bound, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def group_store(store: Any, group_name: str, backend: str) -> Any:
    """The group's key space in ``store``: the layout of SGLang's ``init_custom_process_group``
    (torch's rendezvous, a ``PrefixStore(group_name)``, then ``_new_process_group_helper``'s
    ``"<group>/"`` and ``"<device>/"`` prefixes, the device being the first its backend serves:
    ``cpu`` for gloo, ``cuda`` for nccl), so a real SGLang server joins the group this builds. The
    vLLM bridge (engines/vllm/bridge) builds the same, by hand."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    device = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


def new_group(backend: str, *, master_address: str, master_port: int, rank: int, world_size: int,
              group_name: str, timeout_s: float, store: Any = None) -> Any:
    """Join (rank > 0) or create (rank 0, ``store`` from :func:`master_store`) the group.
    Blocks until every rank has joined (run it in a thread)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown process-group backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
    prefixed = group_store(store, group_name, backend)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        device = (dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if _is_loopback(master_address)
                  else dist.ProcessGroupGloo.create_default_device())
        opts._devices = [device]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)


def abort_group(group: Any) -> None:
    """Abort a group's pending collectives in this process (best effort: unblocks a thread stuck on
    a dead peer sooner than its timeout where the backend supports it)."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        with contextlib.suppress(Exception):
            abort()


def broadcast(group: Any, tensor: torch.Tensor, src: int = 0) -> None:
    """Blocking broadcast of ``tensor`` from ``src`` (in place on the receivers)."""
    group.broadcast(tensor, src).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream().synchronize()


def receive(group: Any, tensor: torch.Tensor, src: int) -> None:
    """Blocking point-to-point receive of ``tensor`` from rank ``src`` (in place)."""
    group.recv([tensor], src, 0).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream().synchronize()


def send(group: Any, tensor: torch.Tensor, dst: int) -> Any:
    """Start sending ``tensor`` to rank ``dst``; the returned work's ``wait()`` ends it."""
    return group.send([tensor], dst, 0)


def in_daemon_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
    """Run a blocking rendezvous / collective in a daemon thread. Unlike ``asyncio.to_thread``,
    a collective stuck until its timeout (a peer refused or died) never holds up the
    interpreter's exit or ``asyncio.run``'s shutdown."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(value)

    def target() -> None:
        try:
            value, exc = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, value, exc)

    threading.Thread(target=target, name="miles-weight-sync", daemon=True).start()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned failure is not "unretrieved"
    return fut
