"""A llama-server process for the golden-file scripts: started on a free
port, waited for until `/health` answers, stopped on exit. Standard library only.

    with LlamaServer(server_path, ["-m", model, "-c", "256"]) as srv:
        ids = srv.post("/tokenize", {"content": text})["tokens"]
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


class LlamaServer:
    def __init__(self, binary, args, timeout=1200, preexec_fn=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [binary, *args, "--port", str(self.port), "--host", "127.0.0.1"]
        self.timeout = timeout
        # Run in the child before exec (e.g. entering a memory cgroup).
        self.preexec_fn = preexec_fn
        self.log = tempfile.NamedTemporaryFile("w", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = None

    def command_line(self):
        """The command as run, the binary named without its directory, and no port."""
        args = self.cmd[1:-4]
        return " ".join([os.path.basename(self.cmd[0]), *args])

    def __enter__(self):
        print(" ".join(self.cmd), file=sys.stderr)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self.log,
                                     preexec_fn=self.preexec_fn)
        for _ in range(1200):
            if self.proc.poll() is not None:
                sys.exit(f"llama-server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except Exception:
                time.sleep(0.5)
        sys.exit(f"llama-server did not become healthy; see {self.log.name}")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()
        return False

    def post(self, path, body):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.load(r)
