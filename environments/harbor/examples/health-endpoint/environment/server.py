"""A tiny HTTP service: answers `ok` at the configured health path."""

import http.server
import json
import os

config = json.load(open(os.path.join(os.environ.get("SERVICE_HOME", "/app"), "config/service.json")))


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == config["health_path"]
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b"ok" if ok else b"no")

    def log_message(self, *args):
        pass


http.server.HTTPServer((config["host"], int(config["port"])), Handler).serve_forever()
