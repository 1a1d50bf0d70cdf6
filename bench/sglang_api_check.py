"""Check a live server against the SGLang API subset miles uses, and print what matched.

For a GPU machine with sglang installed (``--launch`` starts it with our launcher; the model
must be local, e.g. a tiny random model saved with ``save_pretrained``), or any running server
(``--url``, e.g. ``miles serve`` on CPU, which must pass every row).

    python bench/sglang_api_check.py --url http://127.0.0.1:30000
    python bench/sglang_api_check.py --launch /models/tiny-qwen3 [--moe-shape 2,2] [--ckpt DIR]
    python bench/sglang_api_check.py --url http://127.0.0.1:30000 --weights /models/tiny-qwen3

``--weights`` (default: the ``--launch`` model): the policy's safetensors, pushed as the next version
through the broadcast transport (``/init_weights_update_group``, ``/update_weights_from_distributed``,
the group's store keys as SGLang's ``init_custom_process_group`` reads them) and read back tensor by
tensor (``/get_weights_by_name``: ``weights.check_update_equal``) — what a training run does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_engine.engines.http.client import HttpEngine  # noqa: E402
from miles_engine.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from miles_engine.engines.sglang import SGLangLaunchConfig, SGLangServer  # noqa: E402


async def check(url: str, moe_shape: tuple[int, int] | None, ckpt: str | None,
                weights: str | None = None) -> list[tuple[str, bool, str]]:
    rows: list[tuple[str, bool, str]] = []
    raw = httpx.AsyncClient(base_url=url, timeout=120)
    engine = await HttpEngine(url, moe_shape=moe_shape).connect()

    async def row(name: str, coro: Any) -> None:
        try:
            ok, note = await coro
        except Exception as exc:  # noqa: BLE001 - a failed row, not a crash
            ok, note = False, f"{exc.__class__.__name__}: {exc}"[:160]
        rows.append((name, ok, note))

    async def gen_shape() -> tuple[bool, str]:
        r = await raw.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True, "rid": "chk1",
                                              "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        meta = r.json()["meta_info"]
        keys = ["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
                "output_token_logprobs"]
        missing = [k for k in keys if k not in meta]
        triple = all(len(e) == 3 for e in meta.get("output_token_logprobs", []))
        extra = f"output_ids={'output_ids' in r.json()}, weight_versions spans={'weight_versions' in meta}"
        return r.status_code == 200 and not missing and triple, f"missing={missing} {extra}"

    async def client_gen() -> tuple[bool, str]:
        res = await engine.generate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=8, seed=1),
                                                    session_id="chk", return_routed_experts=moe_shape is not None))
        ok = len(res.output_ids) == len(res.output_logprobs) == len(res.weight_versions) > 0
        if moe_shape is not None:
            ok = ok and res.routed_experts is not None and len(res.routed_experts) == len(res.output_ids)
        return ok, f"exact versions={res.info['weight_versions_exact']} finish={res.finish_reason}"

    async def bad_input() -> tuple[bool, str]:
        r = await raw.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 4, "bogus": 1}})
        ok = r.status_code == 400 and (await raw.post("/generate", json={"input_ids": [1]})).status_code == 200
        return ok, f"status {r.status_code}: {r.text[:80]}"

    async def pause_modes() -> tuple[bool, str]:
        for mode in ("abort", "retract", "in_place"):
            await engine.pause(mode)  # type: ignore[arg-type]
            await engine.resume()
        return True, "abort, retract, in_place + continue_generation"

    async def abort() -> tuple[bool, str]:
        task = asyncio.create_task(engine.generate(GenerateRequest([1], SamplingParams(max_new_tokens=4000),
                                                                   request_id="chk-abort")))
        for _ in range(200):  # until the server runs it (a short context may finish it within half a second)
            info = (await raw.get("/get_server_info")).json()
            if any(int(s.get("num_running_reqs") or 0) for s in info.get("internal_states") or []):
                break
            await asyncio.sleep(0.005)
        await engine.abort("chk-abort")
        res = await asyncio.wait_for(task, 60)
        return res.finish_reason == "abort", f"finish={res.finish_reason} after {len(res.output_ids)} tokens"

    async def update_disk() -> tuple[bool, str]:
        if ckpt is None:
            return True, "skipped (no --ckpt)"
        v = await engine.update_weights(Path(ckpt), version=engine.weight_version + 1)
        seen = (await raw.get("/get_weight_version")).json()["weight_version"]
        res = await engine.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))
        return str(seen) == str(v) and res.weight_versions[-1] == v, f"version {seen}"

    async def broadcast_push() -> tuple[bool, str]:
        if weights is None:
            return True, "skipped (no --weights)"
        from safetensors.torch import load_file

        from miles_engine.weights.broadcast import BroadcastTransport
        from miles_engine.weights.check.transport import CheckedTransport

        served = {m.name for m in engine.weight_metadata()}
        tensors: dict[str, Any] = {}
        for f in sorted(Path(weights).glob("*.safetensors")):
            tensors.update({n: t for n, t in load_file(str(f)).items() if n in served})
        transport = CheckedTransport(BroadcastTransport([engine], backend="auto"), [engine])
        try:
            stats = await transport.push(list(tensors.items()), engine.weight_version + 1)
        finally:
            await transport.close()
        seen = (await raw.get("/get_weight_version")).json()["weight_version"]
        ok = stats.tensors_checked == len(tensors) > 0 and str(seen) == str(stats.version)
        return ok, f"{stats.tensors} tensors pushed, {stats.tensors_checked} read back equal, version {seen}"

    for name, coro in [("/generate shape", gen_shape()), ("client generate", client_gen()),
                       ("bad input -> 400", bad_input()), ("pause/continue", pause_modes()),
                       ("abort_request", abort()), ("update_weights_from_disk", update_disk()),
                       ("broadcast push + read-back", broadcast_push())]:
        await row(name, coro)
    info = (await raw.get("/get_model_info")).json()
    rows.append(("/get_model_info", "weight_version" in info, ", ".join(sorted(info))[:160]))
    rows.append(("/health", (await raw.get("/health")).status_code == 200, ""))
    await engine.aclose()
    await raw.aclose()
    return rows


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url")
    p.add_argument("--launch", metavar="MODEL_PATH")
    p.add_argument("--moe-shape", help="layers,top_k of an MoE model (checks routed experts)")
    p.add_argument("--ckpt", help="a safetensors dir for /update_weights_from_disk")
    p.add_argument("--weights", help="the policy's safetensors dir, pushed by broadcast and read back "
                   "(default: the --launch model)")
    a = p.parse_args()
    moe = tuple(int(x) for x in a.moe_shape.split(",")) if a.moe_shape else None
    server = None
    if a.launch:
        server = SGLangServer(SGLangLaunchConfig(a.launch, extra_args=["--skip-tokenizer-init"]))
        await server.start()
        a.url = server.url
    try:
        rows = await check(a.url, moe, a.ckpt, a.weights or a.launch)  # type: ignore[arg-type]
    finally:
        if server is not None:
            await server.stop()
    for name, ok, note in rows:
        print(f"{'PASS' if ok else 'FAIL':<5} {name:<26} {note}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
