"""Source of a fake ``sglang.launch_server`` with real SGLang's response shapes as of the versions
that report one ``weight_version`` per request and no ``output_ids``, and SGLang's weight routes
as its HTTP server defines them: ``/init_weights_update_group`` (joined the way SGLang's
``init_custom_process_group`` does: torch's rendezvous, ``PrefixStore(group_name)``,
``_new_process_group_helper``), ``/update_weights_from_distributed`` (one ``dist.broadcast`` per
tensor, loaded at once), ``/destroy_weights_update_group``, ``/update_weights_from_disk`` (loads
the safetensors files), ``/get_weights_by_name`` (the first ``truncate_size`` rows as float lists),
``/pause_generation`` and ``/continue_generation``. Its "model" is a dict of tensors (torch is imported
by those routes only; the rest is stdlib).

Tests write it to ``<tmp>/sglang/launch_server.py`` and put ``<tmp>`` on PYTHONPATH. Env knobs:
FAKE_SGLANG_DIR (where it records argv, pids, weight-update listings), FAKE_SGLANG_FAIL,
FAKE_SGLANG_HANG, FAKE_SGLANG_IGNORE_TERM, FAKE_SGLANG_CORRUPT (a tensor name it adds 1 to after
each update: what check-weight-update-equal must catch).

Given a quantised checkpoint (``quantization_config`` in its config.json: the FP8 contract), it
loads its tensors at start and, as SGLang's ``load_weights`` does, refuses an update naming a
tensor the checkpoint lacks or giving another dtype or shape. One liberty: gloo cannot broadcast
``float8_e4m3fn`` (torch: "Invalid scalar type"), so a float8 tensor is received as its bytes
(uint8) and viewed as float8; SGLang on CUDA receives it as float8 over NCCL, which moves bytes.
"""

SOURCE = r'''
import argparse, base64, json, os, signal, struct, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--weight-version", default="default"); p.add_argument("--dtype", default="auto")
args, _ = p.parse_known_args()
out = os.environ["FAKE_SGLANG_DIR"]
json.dump(sys.argv[1:], open(os.path.join(out, "argv.json"), "w"))
print("fake sglang starting", flush=True)
if os.environ.get("FAKE_SGLANG_FAIL"):
    print("RuntimeError: CUDA out of memory (fake)", file=sys.stderr, flush=True)
    sys.exit(3)
if os.environ.get("FAKE_SGLANG_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.path.join(out, "pids"), "w").write(f"{os.getpid()} {child.pid}")
if os.environ.get("FAKE_SGLANG_HANG"):
    time.sleep(600)
state = {"version": args.weight_version, "weights": {}, "groups": {}, "paused": None, "strict": False}
config = os.path.join(args.model_path or "", "config.json")
if os.path.isfile(config) and json.load(open(config)).get("quantization_config"):
    from safetensors.torch import load_file
    for f in sorted(os.listdir(args.model_path)):
        if f.endswith(".safetensors"):
            state["weights"].update(load_file(os.path.join(args.model_path, f)))
    state["strict"] = True
    import torch
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else None
    for name, t in state["weights"].items():  # parameters in the server's dtype, except FP8 weights and scales
        if dtype is not None and t.is_floating_point() and t.dtype != torch.float8_e4m3fn and \
                not name.endswith("_scale_inv"):
            state["weights"][name] = t.to(dtype)


def _load(received):
    """The model's load_weights: a parameter it lacks or of another shape is refused; a quantised
    parameter (float8 weight, float32 scale) must come in its own dtype; the rest is cast (copy_)."""
    import torch
    if not state["strict"]:
        state["weights"].update(received)
        return None
    out = {}
    for name, t in received.items():
        held = state["weights"].get(name)
        quantised = held is not None and (held.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"))
        if held is None or held.shape != t.shape or (quantised and held.dtype != t.dtype):
            return (f"load_weights: {name} {t.dtype} {list(t.shape)} does not match the model's "
                    f"{None if held is None else (held.dtype, list(held.shape))}")
        out[name] = t.to(held.dtype)
    state["weights"].update(out)
    return None


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _parameter(name):
    """SGLang's model.get_weights_by_name over a checkpoint's parameters: the fused layers hold one
    parameter (a fused name reads all of it); a part's name is narrowed out of it by the part's
    rows, which a part's tile scales do not follow (SGLang then fails: None, answered as an error)."""
    import torch
    if not state["strict"] or name is None:
        return state["weights"].get(name)
    owner, _, leaf = name.rpartition(".")
    module = owner.rpartition(".")[2]
    if module in FUSED and leaf.endswith("_scale_inv"):
        prefix = owner.rpartition(".")[0]
        parts = [state["weights"].get(f"{prefix}.{m}.{leaf}") for m in FUSED[module]]
        return None if any(p is None for p in parts) else torch.cat(parts)
    if leaf.endswith("_scale_inv") and any(module in members for members in FUSED.values()):
        return None
    return state["weights"].get(name)


def _corrupt():
    name = os.environ.get("FAKE_SGLANG_CORRUPT")
    if name and name in state["weights"]:
        t = state["weights"][name]
        state["weights"][name] = (t.float() + 1).to(t.dtype)


def init_group(body):
    import datetime
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    timeout = datetime.timedelta(seconds=120)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world = next(rendezvous(url, body["rank_offset"], body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    name = body.get("group_name", "weight_update_group")
    pg, _ = _new_process_group_helper(world, rank, [], Backend(body.get("backend", "nccl")), PrefixStore(name, store),
                                      group_name=name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    state["groups"][name] = pg


def receive(body):
    import torch
    import torch.distributed as dist
    pg = state["groups"].get(body.get("group_name", "weight_update_group"))
    if pg is None:
        return False, "no such group"
    received = {}
    for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
        dtype = getattr(torch, str(dtype).removeprefix("torch."))
        if dtype == torch.float8_e4m3fn:
            t = torch.empty(shape, dtype=torch.uint8)
            dist.broadcast(t, src=0, group=pg)
            t = t.view(dtype)
        else:
            t = torch.empty(shape, dtype=dtype)
            dist.broadcast(t, src=0, group=pg)
        received[name] = t
    problem = _load(received)  # after the broadcast, as SGLang loads what it received
    if problem:
        return False, problem
    _corrupt()
    if body.get("weight_version") is not None:
        state["version"] = body["weight_version"]
    return True, "Succeeded to update parameter online."


def load_disk(path):
    from safetensors.torch import load_file
    loaded = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            loaded.update(load_file(os.path.join(path, f)))
    problem = _load(loaded)
    if problem:
        return problem
    _corrupt()

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, body=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path in ("/health", "/health_generate"):
            return self._send(200)
        if self.path == "/get_weight_version":
            return self._send(200, {"weight_version": state["version"]})
        if self.path == "/get_server_info":
            return self._send(200, {"model_path": args.model_path, "version": "0.5.fake"})
        self._send(404, {"detail": "Not Found"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/generate":
            ids, sp = body["input_ids"], body.get("sampling_params", {})
            if any(t >= 1000 for t in ids):
                return self._send(400, {"error": {"message": "token id out of range"}})
            n = sp.get("max_new_tokens", 128)
            json.dump([self.headers.get("X-SMG-Routing-Key"), body.get("routing_key"), body.get("routed_experts_start_len")],
                      open(os.path.join(out, "routing.json"), "w"))
            toks = [(ids[-1] + i + 1) % 1000 for i in range(n)]
            meta = {"id": body.get("rid"), "finish_reason": {"type": "length", "length": n},
                    "prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 1,
                    "weight_version": state["version"],
                    "output_token_logprobs": [[-0.5, t, None] for t in toks]}
            if body.get("return_routed_experts"):
                rows = len(ids) + n - 1  # this old server ignores routed_experts_start_len
                meta["routed_experts"] = base64.b64encode(struct.pack(f"<{rows*4}i", *range(rows*4))).decode()
            return self._send(200, {"text": "x" * n, "meta_info": meta})
        if self.path == "/update_weights_from_disk":
            json.dump({"path": body["model_path"], "files": sorted(os.listdir(body["model_path"]))},
                      open(os.path.join(out, "update.json"), "w"))
            problem = load_disk(body["model_path"])
            if problem:
                return self._send(400, {"success": False, "message": problem})
            state["version"] = body.get("weight_version") or state["version"]
            return self._send(200, {"success": True, "message": "ok", "num_paused_requests": 0})
        if self.path == "/init_weights_update_group":
            try:
                init_group(body)
            except Exception as exc:
                return self._send(400, {"success": False, "message": f"Failed to init group: {exc}"})
            return self._send(200, {"success": True, "message": "Succeeded to initialize custom process group."})
        if self.path == "/update_weights_from_distributed":
            ok, message = receive(body)
            return self._send(200 if ok else 400, {"success": ok, "message": message})
        if self.path == "/destroy_weights_update_group":
            ok = state["groups"].pop(body.get("group_name", "weight_update_group"), None) is not None
            return self._send(200 if ok else 400, {"success": ok, "message": "destroyed" if ok else "no such group"})
        if self.path == "/get_weights_by_name":
            t = _parameter(body.get("name"))
            if t is None:
                return self._send(400, {"error": {"message": f"no parameter {body.get('name')!r}"}})
            rows = t[: int(body.get("truncate_size", 100))] if t.dim() else t
            return self._send(200, rows.float().tolist())
        if self.path in ("/abort_request",):
            return self._send(200)
        if self.path == "/pause_generation":
            state["paused"] = body.get("mode", "abort")
            return self._send(200, {"message": "Generation paused successfully.", "status": "ok"})
        if self.path == "/continue_generation":
            state["paused"] = None
            return self._send(200, {"message": "Generation continued successfully.", "status": "ok"})
        self._send(404, {"detail": "Not Found"})

ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''
