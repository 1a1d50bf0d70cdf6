"""N FSDP2 ranks behind one driver-side object.

    trainer = build_trainer("tiny:qwen3", {"parallel": {"world_size": 2}})   # FSDPTrainer
    trainer.train_step(groups)            # same calls as TorchTrainer
    trainer.close()

:class:`FSDPTrainer` spawns ``world_size`` processes (``torch.multiprocessing``, spawn); each
joins a process group (gloo on CPU, NCCL on GPU: rank r uses ``cuda:r``) and runs a
:class:`TorchTrainer` over an :class:`FSDP2` comm. The proxy validates every batch before it
dispatches anything (a bad batch never reaches a collective), splits it by whole groups
(token-balanced, per minibatch) and talks to each rank over a pipe; rank 0 answers. A rank
that dies or raises fails the trainer (:class:`TrainerError`, with the rank's traceback) and
the other ranks are stopped. Tensors travel as ``torch.save`` bytes.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from datetime import timedelta
from typing import Any

from miles_engine.rollout.types import Group, without_transcripts
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.protocol import TrainerBackend, TrainerError
from miles_engine.trainer.rows import as_sft_rows, balance, split_groups, validate_groups
from miles_engine.weights.rank0 import ExportStash


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


class RankWorker:
    """One rank: joins the process group, builds its trainer and answers commands. A pipe-fed
    process (:func:`_rank_main`) or a Ray actor drives it; ``make(model, cfg, device)``: another
    rank trainer than an FSDP2 ``TorchTrainer``."""

    def __init__(self, rank: int, world: int, init_method: str, model: Any, config: dict,
                 make: Callable[[Any, TrainerConfig, Any], Any] | None = None) -> None:
        import torch
        import torch.distributed as dist

        from miles_engine.trainer.parallel import FSDP2
        from miles_engine.trainer.torch_trainer import TorchTrainer

        cfg = TrainerConfig.load(config)
        if os.environ.get("MILES_TRAINER_STACK_DUMP_S"):  # debugging a hang: dump every rank's stacks
            import faulthandler
            import sys

            faulthandler.dump_traceback_later(float(os.environ["MILES_TRAINER_STACK_DUMP_S"]), repeat=True,
                                              file=sys.stderr)
        if cfg.parallel.device == "cuda":
            torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
            device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        timeout = timedelta(seconds=cfg.parallel.step_timeout_s or 1800)
        if init_method.startswith("tcp://"):  # rank 0's store listens on its host only (see master_store)
            from miles_engine.weights.dist import master_store

            host, _, port = init_method.removeprefix("tcp://").rpartition(":")
            store = (master_store(host.strip("[]"), world, timeout.total_seconds(), int(port)) if rank == 0 else
                     dist.TCPStore(host.strip("[]"), int(port), world, is_master=False, timeout=timeout))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        self.rank = rank
        self.exports = ExportStash()  # rank 0: exports kept for a broadcast from this process
        self.bases_sent = False  # adapter exports: the frozen bases cross to the driver once
        self.trainer = make(model, cfg, device) if make else TorchTrainer(model, cfg, device=device, comm=FSDP2(device))

    def info(self) -> dict[str, Any]:
        return {"vocab_size": self.trainer.vocab_size, "routing": self.trainer.routing}

    def handle(self, cmd: str, arg: Any) -> Any:
        """One command; rank 0's answer (other ranks answer ``None``). Raises what the trainer raises."""
        trainer = self.trainer
        if cmd == "train":  # arg: this rank's minibatches, or (minibatches, rows to record)
            out: Any = trainer.train_minibatches(*arg) if isinstance(arg, tuple) else trainer.train_minibatches(arg)
        elif cmd == "sft":
            out = trainer.sft_step(arg)
        elif cmd == "named_tensors":
            exported = trainer.named_tensors(arg)  # a collective: every rank gathers
            if hasattr(exported, "bases"):  # adapters (trainer.lora.push): the bases never change, sent once
                exported.bases, self.bases_sent = ({} if self.bases_sent else exported.bases), True
            out = _dumps(exported if isinstance(exported, list) else dict(exported)) if self.rank == 0 else None
        elif cmd == "stage_export":  # the export stays here (rank 0); the driver gets its specs
            tensors = dict(trainer.named_tensors())
            out = self.exports.stage(arg[0], tensors, keep=arg[1]) if self.rank == 0 else None
        elif cmd == "state_dict":
            state = trainer.state_dict()
            out = _dumps(state) if self.rank == 0 else None
        elif cmd == "load_state_dict":
            trainer.load_state_dict(_loads(arg))
            out = None
        elif cmd == "call":
            fn, args = arg
            out = fn(trainer, *args)
        elif cmd == "close":
            trainer.close()
            out = None
        else:
            raise ValueError(f"unknown command {cmd!r}")
        return out if self.rank == 0 else None


def _rank_main(rank: int, world: int, init_method: str, model: Any, config: dict, conn: Any,
               make: Callable[[Any, TrainerConfig, Any], Any] | None = None) -> None:
    """A rank process: serve commands from the pipe until ``close``. Ctrl-C is the driver's
    business: ranks ignore SIGINT and stop when the proxy closes them (or its pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker = RankWorker(rank, world, init_method, model, config, make)
        conn.send(("ok", worker.info()))
    except BaseException:  # noqa: BLE001 - reported to the proxy
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            break
        try:
            out = worker.handle(cmd, arg)
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
            break
        conn.send(("ok", out))
        if cmd == "close":
            break


def _offload_rank(trainer: Any) -> dict[str, float]:
    return trainer.offload()


def rank_info(trainer: Any) -> dict[str, Any]:
    """For :meth:`FSDPTrainer.call`: where a rank stands."""
    return {"rank": trainer.comm.rank, "world_size": trainer.comm.world_size, "device": str(trainer.device),
            "weight_version": trainer.weight_version}


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()


class PipeRanks:
    """``world`` rank processes (``torch.multiprocessing``, spawn) on this machine, one pipe each."""

    def __init__(self, world: int, model: Any, config: dict,
                 make: Callable[[Any, TrainerConfig, Any], Any] | None) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        # a file store: no listening socket (a TCPStore listens on every interface, whatever its host)
        self.store_dir = tempfile.mkdtemp(prefix="miles-ranks-")
        init = f"file://{self.store_dir}/store"
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, world, init, model, config, child, make),
                               daemon=True, name=f"miles-trainer-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def send(self, cmd: str, args: Sequence[Any]) -> None:
        for conn, arg in zip(self.conns, args):
            conn.send((cmd, arg))

    def gather(self, timeout: float | None, what: str) -> Any:
        """Rank 0's answer once every rank answered; :class:`TrainerError` on an error or a death."""
        pending = dict(enumerate(self.conns))
        answers: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            for rank, conn in list(pending.items()):
                if conn.poll(0.05):
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        status, payload = "error", "the rank closed its pipe"
                    if status != "ok":
                        raise TrainerError(f"trainer rank {rank} failed during {what}:\n{payload}")
                    answers[rank] = payload
                    del pending[rank]
                elif not self.procs[rank].is_alive():
                    raise TrainerError(f"trainer rank {rank} died during {what} "
                                       f"(exit code {self.procs[rank].exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise TrainerError(f"trainer ranks {sorted(pending)} did not answer {what} within {timeout:.0f} s")
        return answers[0]

    def close(self, grace_s: float = 30.0) -> None:
        for conn in self.conns:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        self.stop()

    def stop(self) -> None:
        _stop(self.procs)
        shutil.rmtree(self.store_dir, ignore_errors=True)


class FSDPTrainer:
    """Driver-side proxy of ``world_size`` FSDP2 ranks; implements :class:`TrainerBackend`.
    ``ranks``: where the ranks run (default :class:`PipeRanks`, processes on this machine; the
    Ray placement passes actors), built as ``ranks(world, model, config_dict, rank_factory)``."""

    rank_factory: Callable[[Any, TrainerConfig, Any], Any] | None = None  # see RankWorker

    def __init__(self, model: Any, config: TrainerConfig | dict[str, Any] | None = None, *,
                 world_size: int | None = None, ranks: Callable[..., Any] | None = None) -> None:
        self.config = TrainerConfig.load(config)
        self.world_size = world_size or self.config.parallel.world_size
        cfg_dict = self.config.model_dump()
        cfg_dict["parallel"]["world_size"] = self.world_size
        self._closed = False
        self._ranks = (ranks or PipeRanks)(self.world_size, model, cfg_dict, self.rank_factory)
        self._finalizer = weakref.finalize(self, self._ranks.stop)
        info = self._gather(self.config.parallel.start_timeout_s, "start")
        self.vocab_size = int(info["vocab_size"])
        self.routing = info["routing"]
        self._version = 0
        self._lora_bases: dict[str, Any] = {}

    # ------------------------------------------------------------------ plumbing
    def _gather(self, timeout: float | None, what: str) -> Any:
        try:
            return self._ranks.gather(timeout, what)
        except TrainerError:
            self._closed = True  # any error or death fails the trainer: the other ranks are stopped
            self._ranks.stop()
            raise

    def _send(self, cmd: str, args: Sequence[Any], what: str | None = None) -> Any:
        if self._closed:
            raise TrainerError("the trainer is closed (or failed earlier)")
        self._ranks.send(cmd, args)
        return self._gather(self.config.parallel.step_timeout_s, what or cmd)

    # ------------------------------------------------------------------ TrainerBackend
    @property
    def weight_version(self) -> int:
        return self._version

    records_rows = True  # rank 0's rows only (the others' are not gathered): see TorchTrainer.train_step

    def train_step(self, groups: Sequence[Group], record: Collection[tuple[str, int]] | None = None) -> dict[str, Any]:
        cfg = self.config
        validate_groups(groups, vocab_size=self.vocab_size, need_teacher=cfg.opd.enabled,
                        std_normalization=cfg.uses_std_normalization, routing=self.routing,
                        need_candidates=cfg.opd.uses_candidates)
        minibatches = split_groups(without_transcripts(groups), min(cfg.minibatches, len(groups)))
        shares = [split_groups(mb, self.world_size) for mb in minibatches]
        per_rank = [[share[r] for share in shares] for r in range(self.world_size)]
        args = per_rank if record is None else [(share, set(record)) for share in per_rank]
        metrics = self._send("train", args, "train_step")
        self._version = int(metrics["weight_version"])
        return metrics

    def sft_step(self, batch: Sequence[Any]) -> dict[str, float]:
        rows = as_sft_rows(batch, self.vocab_size)
        bins = balance([len(r.token_ids) for r in rows], self.world_size)
        metrics = self._send("sft", [[rows[i] for i in b] for b in bins], "sft_step")
        self._version = int(metrics["weight_version"])
        return metrics

    def named_tensors(self, dtype: str | None = None) -> Iterator[tuple[str, Any]]:
        data = _loads(self._send("named_tensors", [dtype] * self.world_size))
        if hasattr(data, "bases"):  # an adapter export: its bases came with the first one
            self._lora_bases = data.bases = data.bases or self._lora_bases
        return data if isinstance(data, list) else iter(data.items())

    def state_dict(self) -> dict[str, Any]:
        return _loads(self._send("state_dict", [None] * self.world_size))

    def stage_export(self, version: int, keep: int | None = None) -> list[Any]:
        """Rank 0 keeps its export under ``version`` (for a broadcast from rank 0) and, of the older
        ones, only ``keep``; returns the tensors' (name, dtype, shape, bytes), not the tensors."""
        return self._send("stage_export", [(version, keep)] * self.world_size)

    def weight_ranks(self) -> Any:
        """The ranks when rank 0 can broadcast the weights itself (Ray actors), else None."""
        return self._ranks if hasattr(self._ranks, "weight_call") else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        light = {k: v for k, v in state.items() if k not in ("model", "optimizer", "sft_optimizer")}
        light.update(model={}, optimizer={}, **({"sft_optimizer": {}} if "sft_optimizer" in state else {}))
        self._send("load_state_dict", [_dumps(state)] + [_dumps(light)] * (self.world_size - 1))
        self._version = int(state["weight_version"])

    def offload(self) -> dict[str, float]:
        """Every rank's state leaves memory until its next command (``trainer.offload``); rank 0's figures."""
        return {} if self.config.offload == "none" else self.call(_offload_rank)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the picklable ``fn(trainer, *args)`` on every rank (e.g. a weight broadcast from
        rank 0); returns rank 0's result."""
        return self._send("call", [(fn, args)] * self.world_size)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ranks.close()
        self._finalizer()

    def __enter__(self) -> FSDPTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_trainer(model: Any, config: TrainerConfig | dict[str, Any] | None = None) -> TrainerBackend:
    """The backend the config asks for: ``parallel.world_size`` 1 -> :class:`TorchTrainer` in this
    process (on ``parallel.device``), N -> :class:`FSDPTrainer` with N ranks."""
    cfg = TrainerConfig.load(config)
    if cfg.parallel.world_size > 1:
        return FSDPTrainer(model, cfg)
    from miles_engine.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(model, cfg)
