"""TEST DOUBLE — a fake SGLang server for the weight-update contract, not an inference engine.

    python tests/support/fakes/sglang_weights.py PORT RECORD_FILE [TP_SIZE]

Implements, on 127.0.0.1, only what `WeightSync` talks to, with the request and answer shapes of
SGLang's HTTP server as written down in docs/engine.md (from SGLang's `http_server.py` and
`io_struct.py`): `/pause_generation`, `/continue_generation`, `/flush_cache`, `/get_weight_version`
(404, as recent SGLang), `/model_info`, `/server_info` (`tp_size`), and
`/update_weights_from_tensor`. For the last it does what an SGLang TP worker does with its entry of
`serialized_named_tensors`: base64-decode, unpickle with torch's multiprocessing reductions (which
maps the sender's shared memory: CUDA IPC handles on a GPU, shared-memory files for CPU tensors),
and, for ``load_format: "flattened_bucket"``, cut the flat tensor by its metadata. It checks every
required field and type, answers 400 ``{"success": false}`` otherwise, and appends one JSON line
per request (path, body keys, received tensor sums) to RECORD_FILE for the test to compare.
"""

from __future__ import annotations

import base64
import json
import pickle
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.multiprocessing  # noqa: F401 - registers the tensor reductions pickle.loads needs

STATE = {"version": "default", "paused": False}


def decode_entry(entry: str, load_format: str | None) -> dict[str, list]:
    obj = pickle.loads(base64.b64decode(entry))  # what SGLang's MultiprocessingSerializer does
    if load_format == "flattened_bucket":
        flat = obj["flattened_tensor"]
        named = []
        for m in obj["metadata"]:
            assert set(m) == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}, m
            t = flat[m["start_idx"] : m["end_idx"]].reshape(m["shape"])
            assert str(t.dtype).removeprefix("torch.") == m["dtype"]
            named.append((m["name"], t))
    else:
        named = list(obj)
    return {n: [str(t.dtype), list(t.shape), float(t.double().sum())] for n, t in named}


class Handler(BaseHTTPRequestHandler):
    record_file = ""
    tp_size = 1

    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, code: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def record(self, entry: dict) -> None:
        with open(self.record_file, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def do_GET(self) -> None:
        if self.path == "/get_weight_version":
            self.reply(404, {"detail": "Not Found"})
        elif self.path == "/model_info":
            self.reply(200, {"model_path": "fake", "weight_version": STATE["version"]})
        elif self.path == "/server_info":
            self.reply(200, {"tp_size": self.tp_size, "weight_version": STATE["version"]})
        else:
            self.reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        if self.path == "/pause_generation":
            STATE["paused"] = True
            self.reply(200, {"message": "Generation paused successfully.", "status": "ok"})
        elif self.path == "/continue_generation":
            STATE["paused"] = False
            self.reply(200, {"message": "Generation continued successfully.", "status": "ok"})
        elif self.path == "/flush_cache":
            self.reply(200, {})
        elif self.path == "/update_weights_from_tensor":
            entries = body.get("serialized_named_tensors")
            fmt = body.get("load_format")
            if not isinstance(entries, list) or len(entries) != self.tp_size:
                self.reply(400, {"success": False, "message": f"need one entry per TP rank ({self.tp_size})"})
                return
            if fmt not in (None, "direct", "flattened_bucket"):
                self.reply(400, {"success": False, "message": f"bad load_format {fmt!r}"})
                return
            try:
                tensors = [decode_entry(e, fmt) for e in entries]
            except Exception as exc:
                self.reply(400, {"success": False, "message": f"{type(exc).__name__}: {exc}"})
                return
            if "weight_version" in body:
                STATE["version"] = str(body["weight_version"])
            self.record({"path": self.path, "keys": sorted(body), "paused": STATE["paused"], "tensors": tensors,
                         "load_format": fmt, "flush_cache": body.get("flush_cache", True)})  # fmt: skip
            self.reply(200, {"success": True, "message": "Succeeded to update parameter online."})
        else:
            self.reply(404, {"detail": "Not Found"})


if __name__ == "__main__":
    Handler.record_file = sys.argv[2]
    Handler.tp_size = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
