"""A :class:`RolloutEngine` over a vLLM OpenAI-compatible server started with ``VLLM_SERVER_DEV_MODE=1``
(its RL routes) and the bridge's worker extension (``miles_vllm_bridge``).

- **Tokens in, tokens out**: ``/v1/completions`` with the prompt as token ids, ``detokenize: false``,
  ``return_token_ids`` and one sampled-token log-prob each (the server runs with
  ``--logprobs-mode processed_logprobs``: after temperature / top-p / top-k, as the protocol asks);
  ``ignore_eos`` with our stop ids, so the model's own EOS stops a request only where we say so.
- **Weight versions**: vLLM keeps a version string per server (``/update_weight_version``, ``/weight_info``);
  every token of a request gets the version its segment ran under. A pause in ``abort`` or ``retract``
  mode ends vLLM's in-flight requests; under ``retract`` (the default) this client sends each one
  again after :meth:`resume`, the tokens so far appended to its prompt, so the new tokens come
  from the new weights and carry the new version. ``in_place`` freezes them in vLLM (``keep``):
  tokens after the resume come from the new weights but vLLM does not say where the switch fell,
  so such a request is marked ``weight_versions_exact=False``.
- **Weights**: the broadcast transport's group calls go through vLLM's weight-transfer API
  (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) to the bridge's ``miles`` backend; :meth:`update_weights` of named
  tensors or a directory (a restart's restore) loads a safetensors file in the workers
  (``/collective_rpc``). Read-back for ``weights.check_update_equal`` in the trainer's names
  (checksums, rows) through the worker extension.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_engine.engines.errors import EngineRefusedUpdate, EngineServerError
from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.protocol import GenerateRequest, GenerateResult, PauseMode, TensorMeta
from miles_engine.engines.vllm.options import WORKER_EXTENSION
from miles_engine.errors import EngineRequestError

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_PAUSE = {"abort": "abort", "retract": "abort", "in_place": "keep", "wait": "wait"}


def parse_version(raw: Any) -> int:
    """vLLM's version string (``"default"`` before any update) as ours."""
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return 0


class VllmEngine(HttpEngine):
    def __init__(self, base_url: str, *, per_request_seeds: bool = True, raw_logprobs: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        # the server records raw log-probs (a speculative one: fleet.vllm_kind.logprobs_mode): they are the
        # sampling distribution's only at temperature 0 or 1 without top-p / top-k, so other requests are refused
        self.raw_logprobs = raw_logprobs
        # vLLM 0.32's CPU worker crashes its engine core (``CPU Generator does not use offset``) when a
        # seeded request shares a step with a partly prefilled one: the kind turns seeds off on CPU
        self.per_request_seeds = per_request_seeds
        self.model_id: str | None = None
        self._retracts = 0  # retract pauses so far: a request aborted by one is sent again
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._caller_aborted: set[str] = set()
        self._wire_ids: dict[str, str] = {}  # request id -> the id of the segment vLLM runs now
        self._updating = False
        self.bridge_missing: str | None = None  # why the worker extension did not answer, if it did not

    def __repr__(self) -> str:
        return f"VllmEngine({self.base_url!r})"

    @property
    def weight_checksums_supported(self) -> bool:
        return bool(self._metadata)

    @property
    def takes_flat_buckets(self) -> bool:
        return True  # the bridge's backend unpacks miles_flat buckets

    async def _rpc(self, method: str, *args: str, kind: str = "control") -> Any:
        resp = await self._call("POST", "/collective_rpc", json={"method": method, "args": list(args)}, kind=kind)
        self._raise_for(resp, f"collective_rpc {method}")
        results = resp.json().get("results") or [None]
        return results[0]

    async def connect(self) -> VllmEngine:
        resp = await self._call("GET", "/v1/models")
        self._raise_for(resp, "v1/models")
        models = resp.json().get("data") or []
        if not models:
            raise ValueError(f"{self.name}: /v1/models lists no model")
        self.model_id = models[0]["id"]
        self.server_info = {"backend": "vllm", "model": self.model_id}
        await self.fetch_weight_version()
        try:
            meta = await self._rpc("miles_weight_metadata")
        except (ValueError, EngineServerError) as exc:  # a server someone else started without the bridge
            self.bridge_missing = str(exc).splitlines()[0]
            meta = []
        self._metadata = [TensorMeta(m[0], m[1], tuple(m[2]), m[3] if len(m) > 3 else None) for m in meta or []]
        return self

    def _need_bridge(self, what: str) -> None:
        if self.bridge_missing:
            raise EngineRefusedUpdate(
                f"{self.name}: {what} needs the miles bridge in the vLLM server (start it with "
                f"PYTHONPATH=<miles_engine/engines/vllm/bridge> --worker-extension-cls {WORKER_EXTENSION} "
                f"--weight-transfer-config '{{\"backend\": \"miles\"}}' and VLLM_SERVER_DEV_MODE=1): "
                f"{self.bridge_missing}")

    async def fetch_weight_version(self) -> int:
        resp = await self._call("GET", "/weight_info")
        self._raise_for(resp, "weight_info")
        self._version = parse_version(resp.json().get("weight_version"))
        return self._version

    # ------------------------------------------------------------------ generation
    def _body(self, request: GenerateRequest, prompt: list[int], max_tokens: int, wire_id: str) -> dict[str, Any]:
        s = request.sampling
        if self.raw_logprobs and request.return_logprob and not (
                s.temperature in (0.0, 1.0) and s.top_p == 1.0 and s.top_k == -1):
            raise EngineRequestError(
                f"{self.name}: this vLLM server speculates (options.speculative) and so records raw log-probs, which "
                f"are the sampling distribution's only at temperature 0 or 1 without top_p / top_k; this request "
                f"asks temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k}. Sample at temperature 1 (or 0), "
                f"or turn speculation off (vLLM 0.32 returns NaN log-probs under speculation otherwise)")
        body: dict[str, Any] = {
            "model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "top_k": s.top_k, "stop_token_ids": list(s.stop_token_ids), "ignore_eos": True,
            "detokenize": False, "skip_special_tokens": False, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "request_id": wire_id}
        if request.return_logprob:
            body["logprobs"] = 0
        if s.seed is not None and self.per_request_seeds:
            body["seed"] = int(s.seed)
        return body

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        rid = request.request_id
        out_ids: list[int] = []
        out_lp: list[float] = []
        versions: list[int] = []
        exact, cached, segments = True, 0, 0
        prompt = list(request.input_ids)
        finish = "abort"
        try:
            while True:
                await self._resumed.wait()
                left = request.sampling.max_new_tokens - len(out_ids)
                version, retracts = self._version, self._retracts
                wire_id = self._wire_ids[rid] = f"{rid}-{segments}"
                body = self._body(request, prompt + out_ids, left, wire_id)
                segments += 1
                resp = await self._call("POST", "/v1/completions", json=body, kind="generate", idempotent=False)
                self._raise_for(resp, f"generate {rid}")
                data = resp.json()
                choice = data["choices"][0]
                ids = [int(t) for t in choice.get("token_ids") or []]
                lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                out_ids += ids
                out_lp += [float(x) for x in lps] if request.return_logprob else []
                after = self._version
                versions += [version] * len(ids)
                if after != version:
                    exact = False  # an update landed while it ran (in_place): where the switch fell is unknown
                usage = data.get("usage") or {}
                if segments == 1:
                    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
                finish = _FINISH.get(choice.get("finish_reason"), "abort")
                # a retract pause since it was sent, even one already resumed when vLLM's answer got here
                retracted = (finish == "abort" and rid not in self._caller_aborted and self._retracts != retracts
                             and len(out_ids) < request.sampling.max_new_tokens)
                if not retracted:
                    break
        finally:
            self._caller_aborted.discard(rid)
            self._wire_ids.pop(rid, None)
        if versions:
            self._seen_version(max(versions))
        info: dict[str, Any] = {"segments": segments}
        if not exact:
            info["weight_versions_exact"] = False
        return GenerateResult(rid, out_ids, out_lp, versions, finish, len(request.input_ids), cached_tokens=cached,
                              info=info)

    async def pause(self, mode: PauseMode = "retract") -> None:
        if mode == "retract":
            self._retracts += 1
        if mode != "in_place":
            self._resumed.clear()
        resp = await self._call("POST", f"/pause?mode={_PAUSE[mode]}", kind="generate" if mode == "wait" else "control")
        self._raise_for(resp, "pause")

    async def resume(self) -> None:
        resp = await self._call("POST", "/resume")
        self._raise_for(resp, "resume")
        self._resumed.set()

    async def abort(self, request_id: str) -> bool:
        wire_id = self._wire_ids.get(request_id)
        if wire_id is None:
            return False
        self._caller_aborted.add(request_id)
        # the engine knows a completion's only prompt as cmpl-<request_id>-0 (vLLM's serving_completion)
        resp = await self._call("POST", "/abort_requests", json={"request_ids": [f"cmpl-{wire_id}-0"]})
        self._raise_for(resp, "abort_requests")
        return True

    # ------------------------------------------------------------------ weights
    async def update_weights(self, weights: Mapping[str, Any] | Path, *, version: int | None = None) -> int:
        new = self._version + 1 if version is None else int(version)
        files = sorted(str(p) for p in Path(weights).glob("*.safetensors")) if isinstance(weights, (str, Path)) else []
        if files and not self.holds_formats:
            await self._load_files(files, new)
            return new
        if isinstance(weights, (str, Path)):  # full-precision files: those held in a format are quantised here
            from miles_engine.engines.http.tensors import load_directory

            weights = await asyncio.to_thread(load_directory, weights, self.name)
        from safetensors.torch import save_file

        from miles_engine.engines.held import held_tensors
        from miles_engine.engines.http.tensors import untied_cpu

        # quantising is CPU work: off the event loop
        tensors = await asyncio.to_thread(lambda: held_tensors(untied_cpu(weights), self._metadata, self.name))
        with tempfile.TemporaryDirectory(prefix="miles-vllm-weights-") as tmp:
            path = str(Path(tmp) / "model.safetensors")
            await asyncio.to_thread(save_file, tensors, path)
            await self._load_files([path], new)
        return new

    async def _load_files(self, files: list[str], version: int) -> None:
        self._need_bridge("loading weights")
        if not files:
            raise EngineRefusedUpdate(f"{self.name}: no *.safetensors file to load")
        answer = await self._rpc("miles_load_safetensors", json.dumps(files), kind="update")
        if isinstance(answer, dict) and answer.get("error"):
            raise EngineRefusedUpdate(f"{self.name}: {answer['error']}")
        # cached prefixes were computed with the old weights
        self._raise_for(await self._call("POST", "/reset_prefix_cache"), "reset_prefix_cache")
        await self._set_version(version)

    async def _set_version(self, version: int) -> None:
        resp = await self._call("POST", "/update_weight_version", json={"new_version": str(version)})
        self._raise_for(resp, "update_weight_version")
        self._version = version

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, *, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:
        self._need_bridge("joining the weight-sync group")
        info = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}
        resp = await self._call("POST", "/init_weight_transfer_engine", json={"init_info": info}, kind="update",
                                idempotent=False)
        self._raise_for(resp, "init_weight_transfer_engine")
        self._updating = False

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              *, group_name: str = "weight_update_group",
                                              weight_version: int | None = None, load_format: str | None = None,
                                              commit: bool | None = None, push_id: str | None = None,
                                              flush_cache: bool = True, **_: Any) -> None:
        """One bucket of a push: the first opens vLLM's update, the one carrying the version closes it."""
        if not self._updating:
            self._raise_for(await self._call("POST", "/start_weight_update", kind="update", idempotent=False),
                            "start_weight_update")
            self._updating = True
        info = {"names": names, "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(s) for s in shapes], "flat": load_format == "miles_flat"}
        resp = await self._call("POST", "/update_weights", json={"update_info": info}, kind="update", idempotent=False)
        self._raise_for(resp, "update_weights")
        last = commit if commit is not None else weight_version is not None
        if last:
            body = {"weight_version": None if weight_version is None else str(weight_version)}
            self._raise_for(await self._call("POST", "/finish_weight_update", json=body, kind="update"),
                            "finish_weight_update")
            self._raise_for(await self._call("POST", "/reset_prefix_cache"), "reset_prefix_cache")
            self._updating = False
            if weight_version is not None:
                self._version = int(weight_version)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._updating = False
        self._raise_for(await self._call("POST", "/shutdown_weight_transfer_engine"), "shutdown_weight_transfer_engine")

    async def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        self._need_bridge("reading weights back")
        return dict(await self._rpc("miles_weight_checksums", json.dumps(names), kind="update") or {})

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        self._need_bridge("reading weights back")
        answer = await self._rpc("miles_tensor_rows", name, str(int(truncate_size)), kind="update")
        return None if answer is None else answer["values"]

    async def update_weights_from_disk_delta(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise EngineRefusedUpdate(f"{self.name} (vLLM) has no disk_delta applier; use weights.transport=broadcast")
