"""Source of a fake ``sglang.launch_server`` (stdlib only) with real SGLang's response shapes
as of the versions that report one ``weight_version`` per request and no ``output_ids``.

Tests write it to ``<tmp>/sglang/launch_server.py`` and put ``<tmp>`` on PYTHONPATH. Env knobs:
FAKE_SGLANG_DIR (where it records argv, pids, weight-update listings), FAKE_SGLANG_FAIL,
FAKE_SGLANG_HANG, FAKE_SGLANG_IGNORE_TERM.
"""

SOURCE = r'''
import argparse, base64, json, os, signal, struct, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
p.add_argument("--weight-version", default="default")
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
state = {"version": args.weight_version}

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
            state["version"] = body.get("weight_version") or state["version"]
            return self._send(200, {"success": True, "message": "ok", "num_paused_requests": 0})
        if self.path in ("/abort_request",):
            return self._send(200)
        if self.path in ("/pause_generation", "/continue_generation"):
            return self._send(200, {"message": "ok", "status": "ok"})
        self._send(404, {"detail": "Not Found"})

ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''
