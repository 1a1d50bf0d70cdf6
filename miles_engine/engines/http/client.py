"""A :class:`RolloutEngine` over HTTP: one client for our server and for a real SGLang server.

Retries: only idempotent calls (health, pause, resume, abort, weight updates to a fixed version,
info) are retried on transport errors, with exponential backoff. ``generate`` is sent exactly
once: a lost connection raises :class:`EngineUnavailable` and the fault-tolerance layer (the
supervisor) decides whether to re-send it.

Against real SGLang: per-token weight versions come from ``meta_info["weight_versions"]`` spans
(recent SGLang); older servers report one ``weight_version`` per request, which then fills every
token and ``result.info["weight_versions_exact"]`` is ``False``. In-memory weight updates are
spilled to a temporary safetensors directory and loaded with ``/update_weights_from_disk``
(SGLang's ``/update_weights_from_tensor`` takes pickled CUDA-IPC handles, colocated only).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from miles_engine.engines.errors import (
    EngineRefusedUpdate,
    EngineServerError,
    EngineUnavailable,
)
from miles_engine.engines.http import tensors, wire
from miles_engine.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TensorMeta,
)

log = logging.getLogger(__name__)


class HttpEngine:
    """Client for an SGLang-compatible server at ``base_url``. Call :meth:`connect` once before
    use (it reads the server kind, weight version and weight metadata)."""

    def __init__(self, base_url: str, *, name: str | None = None, connect_timeout: float = 5.0,
                 generate_timeout: float | None = 900.0, control_timeout: float = 60.0,
                 update_timeout: float = 900.0, health_timeout: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.2, moe_shape: tuple[int, int] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, headers: Mapping[str, str] | None = None,
                 held: Sequence[TensorMeta] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url
        self.moe_shape = moe_shape
        self.retries = retries
        self.backoff_s = backoff_s
        self._timeouts = {"generate": generate_timeout, "control": control_timeout,
                          "update": update_timeout, "health": health_timeout}
        self._connect_timeout = connect_timeout
        self._client = httpx.AsyncClient(
            base_url=self.base_url, transport=transport, headers=dict(headers or {}),
            timeout=httpx.Timeout(control_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
        )
        self._version = 0
        # what the server holds, where it does not say itself (an SGLang server given an FP8 checkpoint)
        self._metadata: list[TensorMeta] = list(held or ())
        self.server_info: dict[str, Any] = {}
        self.is_miles_server = False
        self.pause_counts: Counter[str] = Counter()  # running totals of what pauses did (see pause)

    def __repr__(self) -> str:
        return f"HttpEngine({self.base_url!r})"

    @property
    def weight_checksums_supported(self) -> bool:
        """The server hashes its own tensors (``/miles/weight_checksums``: ours, not SGLang)."""
        return self.is_miles_server

    @property
    def takes_flat_buckets(self) -> bool:
        """The server receives a broadcast bucket as one flat uint8 buffer (``load_format=miles_flat``)."""
        return self.is_miles_server

    # ------------------------------------------------------------------ plumbing
    def _timeout(self, kind: str) -> httpx.Timeout:
        return httpx.Timeout(self._timeouts[kind], connect=self._connect_timeout)

    async def _call(self, method: str, path: str, *, json: Any = None, kind: str = "control",
                    idempotent: bool = True, headers: Mapping[str, str] | None = None) -> httpx.Response:
        attempts = 1 + (self.retries if idempotent else 0)
        for attempt in range(attempts):
            if self._client.is_closed:
                raise EngineUnavailable(f"engine client {self.name} is closed")
            try:
                return await self._client.request(method, path, json=json, headers=headers, timeout=self._timeout(kind))
            except httpx.TransportError as exc:
                if attempt + 1 >= attempts:
                    raise EngineUnavailable(f"engine {self.name} did not answer {method} {path}: "
                                            f"{exc.__class__.__name__}: {exc}") from exc
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def _message(resp: httpx.Response) -> str:
        try:
            body = resp.json()
        except ValueError:
            return resp.text[:500] or resp.reason_phrase
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
            if body.get("message"):  # SGLang's validation / weight-update bodies
                return str(body["message"])
        return str(body)[:500]

    def _raise_for(self, resp: httpx.Response, what: str) -> None:
        if resp.status_code < 400:
            return
        msg = f"{self.name} {what}: {self._message(resp)}"
        if resp.status_code in (400, 404, 422):
            raise ValueError(msg)
        if resp.status_code == 503:
            raise EngineUnavailable(msg)
        raise EngineServerError(f"HTTP {resp.status_code} from {msg}")

    def _seen_version(self, version: int) -> None:
        self._version = max(self._version, version)

    # ------------------------------------------------------------------ protocol
    async def connect(self) -> HttpEngine:
        resp = await self._call("GET", "/get_server_info")
        self._raise_for(resp, "get_server_info")
        self.server_info = resp.json()
        self.is_miles_server = self.server_info.get("backend") == "miles"
        resp = await self._call("GET", "/get_weight_version")
        self._raise_for(resp, "get_weight_version")
        self._version = wire.parse_version(resp.json().get("weight_version"))
        if self.is_miles_server:
            resp = await self._call("GET", "/miles/weight_metadata")
            self._raise_for(resp, "weight_metadata")
            self._metadata = [TensorMeta(m["name"], m["dtype"], tuple(m["shape"]), m.get("format"))
                              for m in resp.json()]
        return self

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        body, headers = wire.request_to_wire(request)
        resp = await self._call("POST", "/generate", json=body, kind="generate", idempotent=False, headers=headers)
        self._raise_for(resp, f"generate {request.request_id}")
        result = wire.result_from_wire(resp.json(), request, self.moe_shape)
        result.request_id = request.request_id
        if not request.return_routed_experts:
            result.routed_experts = None
        if result.weight_versions:
            self._seen_version(max(result.weight_versions))
        return result

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Pauses; what the pause did to running requests (our servers say: ``retracted``,
        ``kept_in_place``, ``aborted``; others nothing) is added to :attr:`pause_counts`."""
        # wait: answered once the running requests have finished, as long as a generation may take
        kind = "generate" if mode == "wait" else "control"
        resp = await self._call("POST", "/pause_generation", json={"mode": mode}, kind=kind)
        self._raise_for(resp, "pause_generation")
        try:
            said = resp.json().get("miles_pause") or {}
        except (ValueError, AttributeError):  # real SGLang answers 200 with an empty body
            said = {}
        self.pause_counts.update({str(k): int(v) for k, v in said.items() if isinstance(v, int)})

    async def resume(self) -> None:
        self._raise_for(await self._call("POST", "/continue_generation", json={}), "continue_generation")

    async def abort(self, request_id: str) -> bool:
        resp = await self._call("POST", "/abort_request", json={"rid": request_id})
        self._raise_for(resp, "abort_request")
        try:
            return bool(resp.json().get("success", True))
        except ValueError:  # real SGLang answers 200 with an empty body
            return True

    async def update_weights(self, weights: Mapping[str, Any] | Path, *, version: int | None = None) -> int:
        new = self._version + 1 if version is None else int(version)
        if isinstance(weights, (str, Path)) and self.holds_formats and not self.is_miles_server:
            weights = await asyncio.to_thread(tensors.load_directory, Path(weights), self.name)
        if isinstance(weights, (str, Path)):
            await self._update_from_disk(Path(weights), new)
        elif self.is_miles_server:
            body = {"serialized_named_tensors": tensors.encode_named_tensors(weights),
                    "load_format": tensors.TENSOR_LOAD_FORMAT, "weight_version": str(new)}
            resp = await self._call("POST", "/update_weights_from_tensor", json=body, kind="update")
            self._raise_for(resp, "update_weights_from_tensor")
        else:
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="miles-weights-") as tmp:
                named = tensors.untied_cpu(weights)
                if self.holds_formats:  # quantised here from the given values, as a push would
                    from miles_engine.engines.held import fp8_checkpoint_tensors, held_tensors

                    named = await asyncio.to_thread(
                        lambda: fp8_checkpoint_tensors(held_tensors(named, self._metadata, self.name), self._metadata))
                save_file(named, str(Path(tmp) / "model.safetensors"))
                await self._update_from_disk(Path(tmp), new)
        self._version = new
        return new

    async def _update_from_disk(self, path: Path, version: int) -> None:
        body = {"model_path": str(path), "weight_version": str(version), "abort_all_requests": False}
        resp = await self._call("POST", "/update_weights_from_disk", json=body, kind="update")
        self._raise_for(resp, "update_weights_from_disk")
        data = resp.json()
        if isinstance(data, dict) and data.get("success") is False:
            raise ValueError(f"{self.name} update_weights_from_disk: {data.get('message')}")

    def weight_metadata(self) -> list[TensorMeta]:
        return list(self._metadata)

    @property
    def holds_formats(self) -> bool:
        """Some weights are held in a quantised format: they travel as codes + scales."""
        return any(m.format for m in self._metadata)

    # ------------------------------------------------------------------ weight sync (SGLang names)
    async def fetch_weight_version(self) -> int:
        """The version the server reports now (refreshes :attr:`weight_version`)."""
        resp = await self._call("GET", "/get_weight_version")
        self._raise_for(resp, "get_weight_version")
        self._version = wire.parse_version(resp.json().get("weight_version"))
        return self._version

    async def _weights_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self._call("POST", path, json=body, kind="update", idempotent=False)
        self._raise_for(resp, path.strip("/"))
        data = resp.json()
        if isinstance(data, dict) and data.get("success") is False:
            raise ValueError(f"{self.name} {path.strip('/')}: {data.get('message')}")
        return data if isinstance(data, dict) else {}

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:
        """Join the trainer's process group as rank ``rank_offset`` (blocks until all joined)."""
        await self._weights_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              *, group_name: str = "weight_update_group",
                                              weight_version: int | None = None, load_format: str | None = None,
                                              commit: bool | None = None, push_id: str | None = None,
                                              flush_cache: bool = True, p2p_src: int | None = None) -> None:
        """Receive one bucket broadcast by rank 0. Our server only: ``commit=False`` stages it,
        ``push_id`` names the push it belongs to (staged buckets of another push are discarded)."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache, "abort_all_requests": False, "load_format": load_format,
                                "weight_version": None if weight_version is None else str(weight_version)}
        if commit is not None:
            body["miles_commit"] = commit
        if push_id is not None:
            body["miles_push_id"] = push_id
        if p2p_src is not None:  # the p2p transport: point to point from that group rank
            body["miles_p2p_src"] = int(p2p_src)
        if not self.is_miles_server and self.holds_formats:
            from miles_engine.engines.held import fp8_wire_specs

            body["names"], body["dtypes"], body["shapes"] = fp8_wire_specs(names, dtypes, shapes, self._metadata)
        await self._weights_call("/update_weights_from_distributed", body)
        if weight_version is not None and commit is not False:
            self._version = int(weight_version)

    async def commit_staged(self, *, group_name: str, weight_version: int, push_id: str) -> None:
        """Load what the buckets of push ``push_id`` staged (our server; the p2p transport)."""
        await self._weights_call("/update_weights_from_distributed", {
            "miles_commit_only": True, "group_name": group_name, "weight_version": str(weight_version),
            "miles_push_id": push_id})
        self._version = int(weight_version)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._weights_call("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_disk_delta(self, publish_root: str, version: int, *, engine: str,
                                             local_dir: str | None = None, snapshot_every: int = 1,
                                             pause_mode: PauseMode = "retract",
                                             pull_timeout_s: float = 60.0, resync: bool = False) -> dict[str, Any]:
        """Our server only (not SGLang's): the engine pulls the disk_delta versions it lacks from
        ``publish_root`` (as mounted on its host), verifies, loads ``version``; returns its answer
        (``stats``: pull/apply/pause seconds, wire bytes). A refusal raises :class:`EngineRefusedUpdate`
        with the server's answer (the disk_delta transport maps it to its own error class); the engine
        keeps its old weights. Retried on transport errors: a second call for a version the engine
        already holds changes nothing. ``resync``: the engine may have been restarted or loaded other
        weights since its last sync; if its disk_delta copy does not match what it serves, it rebuilds
        the copy (baseline or local copy, replayed) and loads ``version`` in full."""
        body = {"publish_root": str(publish_root), "version": int(version), "engine": engine,
                "local_dir": local_dir, "snapshot_every": int(snapshot_every), "pause_mode": pause_mode,
                "pull_timeout_s": float(pull_timeout_s)}
        if resync:
            body["resync"] = True
        resp = await self._call("POST", "/update_weights_from_disk_delta", json=body, kind="update")
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code >= 400 or not isinstance(data, dict) or data.get("success") is not True:
            raise EngineRefusedUpdate(self.base_url, resp.status_code, data, self._message(resp), version)
        self._version = wire.parse_version(data["weight_version"])
        return data

    async def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """sha256 per tensor as the server holds it (our server, embedded engines)."""
        resp = await self._call("POST", "/miles/weight_checksums", json={"names": names})
        self._raise_for(resp, "weight_checksums")
        return dict(resp.json()["checksums"])

    async def keep_lora_base(self, names: list[str]) -> dict[str, str]:
        """The server keeps the base of each weight for adapter-only pushes; their float32 digests."""
        resp = await self._call("POST", "/miles/lora_base", json={"names": list(names)}, kind="update")
        self._raise_for(resp, "lora_base")
        return dict(resp.json()["digests"])

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """SGLang's ``/get_weights_by_name``: the tensor's first ``truncate_size`` rows as nested
        float32 lists (debugging: slow for big tensors)."""
        resp = await self._call("POST", "/get_weights_by_name", json={"name": name, "truncate_size": int(truncate_size)},
                                kind="update")
        self._raise_for(resp, "get_weights_by_name")
        return resp.json()

    async def health(self) -> bool:
        """``GET /health`` answered 200; never raises."""
        if self._client.is_closed:
            return False
        try:
            resp = await self._client.get("/health", timeout=self._timeout("health"))
        except (httpx.TransportError, RuntimeError):  # RuntimeError: closed concurrently
            return False
        return resp.status_code == 200

    async def aclose(self) -> None:
        await self._client.aclose()
