"""A stand-in SGLang server: SGLang's RL weight-update HTTP API over a plain HF model.

Follows the request schemas and receive semantics of SGLang 0.5.x (`python/sglang/srt/managers/
io_struct.py`, `entrypoints/http_server.py`, `model_executor/model_runner.py` as of 0.5.2-0.5.5):
- `/init_weights_update_group` {master_address, master_port, rank_offset, world_size, group_name,
  backend}: joins a torch.distributed group as rank `rank_offset + tp_rank` (here tp_rank 0; gloo).
- `/update_weights_from_distributed` {names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version, load_format}: with `load_format="flattened_bucket"` receives
  ONE broadcast from rank 0 of the tensors' bytes concatenated without padding; otherwise one
  broadcast per tensor. Then `load_weights` (here: copy into the HF model's state dict). As in
  SGLang, an unknown name or a wrong shape fails only after the bytes were received, answering
  400 {"success": false, "message": ...} with the model partially updated.
- `/destroy_weights_update_group` {group_name}, `/pause_generation` {mode: abort|retract|in_place},
  `/continue_generation` {}, `/flush_cache`, `/update_weight_version` {new_version,
  abort_all_requests}, `/get_weight_version`, `/get_model_info`, `/health`, and `/generate`
  {input_ids, sampling_params: {max_new_tokens, temperature}} -> {output_ids, meta_info}.

Run: `python tests/sglang_standin.py --model-path DIR` prints `SGLANG_STANDIN_PORT=<port>`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ckpt_engine.rollout_adapters.sglang import custom_process_group  # noqa: E402

logger = logging.getLogger("sglang_standin")


class StandinEngine:
    def __init__(self, model_path: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_path = model_path
        config = AutoConfig.from_pretrained(model_path)
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.params = dict(self.model.state_dict())
        self.groups: dict[str, Any] = {}
        self.weight_version = "default"
        self.paused = False
        self.lock = threading.Lock()  # SGLang's scheduler handles one control request at a time
        self.updates = 0

    def init_group(self, req: dict[str, Any]) -> dict[str, Any]:
        keys = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
        if not keys <= set(req):
            return {"success": False, "message": f"missing fields {sorted(keys - set(req))}"}
        store, group = custom_process_group(
            req["master_address"], int(req["master_port"]), int(req["rank_offset"]), int(req["world_size"]),
            req["group_name"], req["backend"], 60.0,
        )
        probe = torch.zeros(1)
        group.broadcast(probe, 0).wait(datetime.timedelta(seconds=60))
        self.groups[req["group_name"]] = (store, group)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update(self, req: dict[str, Any]) -> dict[str, Any]:
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        group_name = req.get("group_name", "weight_update_group")
        if group_name not in self.groups:
            return {"success": False, "message": f"Group {group_name} not in {list(self.groups)}"}
        group = self.groups[group_name][1]
        tensors = [torch.empty(s, dtype=getattr(torch, d)) for d, s in zip(dtypes, shapes)]
        if req.get("load_format") == "flattened_bucket":
            flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
            group.broadcast(flat, 0).wait(datetime.timedelta(seconds=60))
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                t.reshape(-1).view(torch.uint8).copy_(flat[off : off + n])
                off += n
        else:
            for t in tensors:
                group.broadcast(t, 0).wait(datetime.timedelta(seconds=60))
        try:
            with torch.no_grad():
                for name, t in zip(names, tensors):
                    if name not in self.params:
                        raise KeyError(name)
                    self.params[name].copy_(t.view(self.params[name].shape))
        except Exception as exc:
            return {"success": False, "message": f"Failed to update parameter online: {exc!r}. The full weights of the ModelRunner are partially updated. Please discard the whole weights."}
        self.updates += 1
        if req.get("weight_version") is not None:
            self.weight_version = str(req["weight_version"])
        return {"success": True, "message": "Succeeded to update parameter online."}

    @torch.no_grad()
    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        ids = torch.tensor([req["input_ids"]])
        out = []
        for _ in range(int(req.get("sampling_params", {}).get("max_new_tokens", 16))):
            nxt = int(self.model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        return {"output_ids": out, "meta_info": {"weight_version": self.weight_version, "completion_tokens": len(out)}}


def make_handler(engine: StandinEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}") if n else {}

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, "")
            elif self.path == "/get_model_info":
                self._reply(200, {"model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True})
            elif self.path == "/get_weight_version":
                self._reply(200, {"weight_version": engine.weight_version})
            elif self.path == "/flush_cache":
                self._reply(200, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")
            else:
                self._reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = self._body()
            path = self.path
            if path == "/generate":
                self._reply(200, engine.generate(body))
                return
            with engine.lock:
                if path == "/init_weights_update_group":
                    r = engine.init_group(body)
                    self._reply(200 if r["success"] else 400, r)
                elif path == "/update_weights_from_distributed":
                    r = engine.update(body)
                    self._reply(200 if r["success"] else 400, r)
                elif path == "/destroy_weights_update_group":
                    engine.groups.pop(body.get("group_name", "weight_update_group"), None)
                    self._reply(200, {"success": True, "message": "Succeeded to destroy custom process group."})
                elif path == "/pause_generation":
                    if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
                        self._reply(400, {"error": f"Invalid mode: {body.get('mode')!r}"})
                        return
                    engine.paused = True
                    self._reply(200, {"message": "Generation paused successfully.", "status": 200})
                elif path == "/continue_generation":
                    engine.paused = False
                    self._reply(200, {"message": "Generation continued successfully.", "status": 200})
                elif path == "/flush_cache":
                    self._reply(200, "Cache flushed.\n")
                elif path == "/update_weight_version":
                    engine.weight_version = str(body["new_version"])
                    self._reply(200, {"success": True, "message": f"Weight version updated to {engine.weight_version}", "new_version": engine.weight_version})
                else:
                    self._reply(404, {"detail": "Not Found"})

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    engine = StandinEngine(args.model_path)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(engine))
    print(f"SGLANG_STANDIN_PORT={server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
