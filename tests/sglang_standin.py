"""A stand-in SGLang server: SGLang's RL weight-update HTTP API over a plain HF model.

Follows the request schemas and semantics of SGLang 0.5.x as documented in SGLang's
`docs/advanced_features/sglang_for_rl.md` and implemented in `entrypoints/http_server.py`,
`managers/scheduler.py` and `model_executor/model_runner.py` (checked November 2026):
- `/init_weights_update_group` {master_address, master_port, rank_offset, world_size, group_name,
  backend}: joins a torch.distributed group as rank `rank_offset + tp_rank` (here tp_rank 0; gloo).
- `/update_weights_from_distributed` {names, dtypes, shapes, group_name, flush_cache=True,
  abort_all_requests, weight_version, load_format}: with `load_format="flattened_bucket"` receives
  ONE broadcast from rank 0 of the tensors' bytes concatenated without padding (SGLang's
  `FlattenedTensorBucket`); otherwise one broadcast per tensor. Then `load_weights` (here: copy
  into the HF model). An unknown name or a wrong shape fails only after the bytes were received,
  answering 400 {"success": false, "message": ...} with the model partially updated. On success
  the version is set when `weight_version` is given, and the cache is flushed when `flush_cache`
  (default true): SGLang asserts that flush, so when requests are still queued or running the
  scheduler dies (here: 500, and the server stops answering).
- `/pause_generation` {mode: abort (default) | retract | in_place}: abort ends every request now
  (finish reason abort); in_place freezes them with their KV; retract moves them back to the queue
  without KV, to be recomputed (under whatever weights are loaded then) after
  `/continue_generation` {}.
- `/flush_cache` (GET or POST): empties the prefix cache, or answers 400 while a request holds KV
  (running, or paused in place): SGLang's io_struct says a flush fails under `in_place` and works
  under `retract`.
- A prefix cache like SGLang's radix cache: the KV of a prompt is kept and reused by the next
  request with the same prompt, so a weight update without a flush keeps serving old-weight KV.
- `/load_lora_adapter` {lora_name, lora_path, pinned}: reads the PEFT folder at `lora_path` (PEFT's
  own loader; here merged into a copy of the model) and serves it to `/generate` requests whose
  `lora_path` names it; a name already loaded answers 400 {"success": false, "error_message"}.
  `/unload_lora_adapter` {lora_name}: new requests can no longer name it; answers once the requests
  using it finished (SGLang's `LoRARegistry.wait_for_unload`). `/lora_adapters` (stand-in only): the
  loaded names and their tensors' checksums, for the tests.
- `/destroy_weights_update_group` {group_name}, `/update_weight_version` {new_version,
  abort_all_requests}, `/get_weight_version`, `/get_model_info`, `/get_load` (requests in flight),
  `/health`, and `/generate`
  {input_ids, sampling_params: {max_new_tokens, temperature}} -> {output_ids, meta_info}.

Every POST body except `/generate`'s is first checked against SGLang's own request class for its
route (`tests/sglang_schema.py` reads them from the installed SGLang wheel): a body SGLang would
refuse answers 422, as SGLang's FastAPI server does, and so does a key SGLang would silently drop.

Run: `python tests/sglang_standin.py --model-path DIR` prints `SGLANG_STANDIN_PORT=<port>`.
`--fail-after-updates N`: the scheduler dies at the (N+1)-th `/update_weights_from_distributed`
before it joins the broadcast (500, then 503 to everything) while the process, and its end of the
weight-update group, live on: a server that died mid-stream without closing its connections.
"""

from __future__ import annotations

import argparse
import copy
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
sys.path.insert(0, os.path.dirname(__file__))
from ckpt_engine.rollout_adapters.sglang.rollout import custom_process_group  # noqa: E402
from sglang_schema import SglangSchemaError, check_body  # noqa: E402

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
        self.lock = threading.Lock()  # SGLang's scheduler handles one control request at a time
        self.updates = 0
        self.flushes = 0
        self.dead = False
        self.fail_after: int | None = None
        # Scheduler state: requests in flight, pause, and the prefix cache (prompt -> its KV).
        self.cond = threading.Condition()
        self.step = threading.Lock()  # one forward pass or one weight load at a time, like SGLang's scheduler loop
        self.inflight = 0
        self.paused = False
        self.pause_mode = ""
        self.abort_epoch = 0
        self.retract_epoch = 0
        self.prefix_cache: dict[tuple[int, ...], Any] = {}
        self.loras: dict[str, tuple[torch.nn.Module, dict[str, float]]] = {}  # name -> (merged model, tensor sums)
        self.lora_users: dict[str, int] = {}

    def kv_held(self) -> bool:
        """Whether some request holds KV a flush would pull from under it."""
        with self.cond:
            return self.inflight > 0 and not (self.paused and self.pause_mode in ("retract", "abort"))

    def flush(self) -> bool:
        if self.kv_held():
            return False
        self.prefix_cache.clear()
        self.flushes += 1
        return True

    def pause(self, mode: str) -> None:
        """Returns once no forward pass is running (SGLang answers after the current batch)."""
        with self.cond:
            self.paused, self.pause_mode = True, mode
            if mode == "abort":
                self.abort_epoch += 1
            elif mode == "retract":
                self.retract_epoch += 1
            self.cond.notify_all()
        with self.step:
            pass

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

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

    def load_lora(self, req: dict[str, Any]) -> dict[str, Any]:
        import peft
        from safetensors.torch import load_file

        name, path = req["lora_name"], req["lora_path"]
        if name in self.loras:
            return {"success": False, "error_message": f"LoRA adapter {name!r} is already loaded"}
        try:
            model = peft.PeftModel.from_pretrained(copy.deepcopy(self.model), path).merge_and_unload().eval()
            sums = {n: float(t.double().sum()) for n, t in load_file(os.path.join(path, "adapter_model.safetensors")).items()}
        except Exception as exc:  # noqa: BLE001 - answered like SGLang does
            return {"success": False, "error_message": f"Failed to load LoRA adapter {name!r} from {path!r}: {exc!r}"}
        self.loras[name] = (model, sums)
        return {"success": True, "loaded_adapters": {n: n for n in self.loras}}

    def unload_lora(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req["lora_name"]
        with self.cond:
            if name not in self.loras:
                return {"success": False, "error_message": f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loras)}"}
            self.loras.pop(name)  # new requests can no longer name it
            while self.lora_users.get(name, 0) > 0:
                self.cond.wait(0.05)
        return {"success": True, "loaded_adapters": {n: n for n in self.loras}}

    def update(self, req: dict[str, Any]) -> dict[str, Any]:
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        group_name = req.get("group_name", "weight_update_group")
        if group_name not in self.groups:
            return {"success": False, "message": f"Group {group_name} not in {list(self.groups)}"}
        group = self.groups[group_name][1]
        if self.fail_after is not None and self.updates >= self.fail_after:
            self.dead = True
            raise RuntimeError("the scheduler died (stand-in --fail-after-updates)")
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
            with torch.no_grad(), self.step:
                for name, t in zip(names, tensors):
                    if name not in self.params:
                        raise KeyError(name)
                    self.params[name].copy_(t.view(self.params[name].shape))
        except Exception as exc:
            return {"success": False, "message": f"Failed to update parameter online: {exc!r}. The full weights of the ModelRunner are partially updated. Please discard the whole weights."}
        self.updates += 1
        if req.get("flush_cache", True) and not self.flush():  # (SGLang asserts the flush)
            self.dead = True  # SGLang: `assert flush_cache_success` in the scheduler
            raise RuntimeError("AssertionError: Cache flush failed after updating weights")
        if req.get("weight_version") is not None:
            self.weight_version = str(req["weight_version"])
        return {"success": True, "message": "Succeeded to update parameter online."}

    @torch.no_grad()
    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        prompt = tuple(int(t) for t in req["input_ids"])
        lora = req.get("lora_path")
        with self.cond:
            if lora is not None and lora not in self.loras:
                raise KeyError(f"LoRA {lora!r} is not loaded")
            model = self.loras[lora][0] if lora is not None else self.model
            self.inflight += 1
            if lora is not None:
                self.lora_users[lora] = self.lora_users.get(lora, 0) + 1
            epoch = self.abort_epoch
        try:
            return self._generate(prompt, int(req.get("sampling_params", {}).get("max_new_tokens", 16)), epoch, model, lora)
        finally:
            with self.cond:
                self.inflight -= 1
                if lora is not None:
                    self.lora_users[lora] -= 1
                self.cond.notify_all()

    def _wait_runnable(self, epoch: int) -> bool:
        """Block while paused; False when an abort pause ended this request."""
        with self.cond:
            while self.paused and self.abort_epoch == epoch:
                self.cond.wait(0.05)
            return self.abort_epoch == epoch

    def _forward(self, ids: tuple[int, ...], past: Any, model: torch.nn.Module | None = None) -> tuple[Any, torch.Tensor]:
        with self.step:
            result = (model if model is not None else self.model)(torch.tensor([ids]), past_key_values=past, use_cache=True)
        return result.past_key_values, result.logits[0, -1]

    def _generate(
        self, prompt: tuple[int, ...], max_new_tokens: int, epoch: int, model: torch.nn.Module | None = None, lora: str | None = None
    ) -> dict[str, Any]:
        out: list[int] = []
        finish = "length"
        if not self._wait_runnable(epoch):
            return {"output_ids": out, "meta_info": {"weight_version": self.weight_version, "completion_tokens": 0, "finish_reason": {"type": "abort"}}}
        # Like SGLang's radix cache: the KV of the prompt (all but its last token, which is always
        # computed) is kept and reused by a later request with the same prompt.
        prefix, past = prompt[:-1], None
        if prefix and lora is None:  # (SGLang keys its radix cache by adapter too; none kept here)
            cached = self.prefix_cache.get(prefix)
            if cached is None:
                cached, _ = self._forward(prefix, None)
                self.prefix_cache[prefix] = cached
            past = copy.deepcopy(cached)
        elif prefix:
            past, _ = self._forward(prefix, None, model)
        past, logits = self._forward(prompt[-1:], past, model)
        retracted = self.retract_epoch
        for _ in range(max_new_tokens):
            nxt = int(logits.argmax())
            out.append(nxt)
            if len(out) == max_new_tokens:
                break
            if not self._wait_runnable(epoch):
                finish = "abort"
                break
            if self.retract_epoch != retracted:  # retracted: the KV was dropped, recompute it all
                retracted = self.retract_epoch
                past, logits = self._forward(prompt + tuple(out), None, model)
            else:
                past, logits = self._forward((nxt,), past, model)
        meta = {"weight_version": self.weight_version, "completion_tokens": len(out), "finish_reason": {"type": finish}}
        return {"output_ids": out, "meta_info": meta}


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

        def _flush(self) -> None:
            ok = engine.flush()
            self._reply(200 if ok else 400, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")

        def do_GET(self) -> None:
            if engine.dead:
                self._reply(503, "")
            elif self.path == "/health":
                self._reply(200, "")
            elif self.path == "/get_model_info":
                self._reply(200, {"model_path": engine.model_path, "tokenizer_path": engine.model_path, "is_generation": True})
            elif self.path == "/get_weight_version":
                self._reply(200, {"weight_version": engine.weight_version})
            elif self.path == "/flush_cache":
                self._flush()
            elif self.path == "/lora_adapters":
                self._reply(200, {n: sums for n, (_, sums) in engine.loras.items()})
            elif self.path == "/get_load":
                with engine.cond:
                    self._reply(200, [{"dp_rank": 0, "num_reqs": engine.inflight, "num_waiting_reqs": 0, "num_tokens": 0}])
            else:
                self._reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = self._body()
            path = self.path
            if engine.dead:
                self._reply(503, "")
                return
            if path == "/generate":
                try:
                    self._reply(200, engine.generate(body))
                except KeyError as exc:
                    self._reply(400, {"error": {"message": str(exc)}})
                return
            if path != "/flush_cache":  # SGLang's flush takes no body
                try:
                    check_body(path, body)
                except SglangSchemaError as exc:
                    self._reply(422, {"detail": str(exc)})
                    return
            if path in ("/load_lora_adapter", "/unload_lora_adapter"):  # SGLang's LoRA updates are not scheduler-blocking
                r = engine.load_lora(body) if path == "/load_lora_adapter" else engine.unload_lora(body)
                self._reply(200 if r["success"] else 400, r)
                return
            with engine.lock:
                if path == "/init_weights_update_group":
                    r = engine.init_group(body)
                    self._reply(200 if r["success"] else 400, r)
                elif path == "/update_weights_from_distributed":
                    try:
                        r = engine.update(body)
                    except RuntimeError as exc:
                        self._reply(500, {"detail": str(exc)})
                        return
                    self._reply(200 if r["success"] else 400, r)
                elif path == "/destroy_weights_update_group":
                    engine.groups.pop(body.get("group_name", "weight_update_group"), None)
                    self._reply(200, {"success": True, "message": "Succeeded to destroy custom process group."})
                elif path == "/pause_generation":
                    mode = body.get("mode", "abort")
                    if mode not in ("abort", "retract", "in_place"):
                        self._reply(400, {"error": f"Invalid mode: {mode!r}"})
                        return
                    engine.pause(mode)
                    self._reply(200, {"message": "Generation paused successfully.", "status": "ok"})
                elif path == "/continue_generation":
                    engine.resume()
                    self._reply(200, {"message": "Generation continued successfully.", "status": "ok"})
                elif path == "/flush_cache":
                    self._flush()
                elif path == "/update_weight_version":
                    engine.weight_version = str(body["new_version"])
                    self._reply(200, {"success": True, "message": f"Weight version updated to {engine.weight_version}", "new_version": engine.weight_version})
                else:
                    self._reply(404, {"detail": "Not Found"})

    return Handler


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fail-after-updates", type=int, default=None)
    args = p.parse_args(argv)
    engine = StandinEngine(args.model_path)
    engine.fail_after = args.fail_after_updates
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(engine))
    print(f"SGLANG_STANDIN_PORT={server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
