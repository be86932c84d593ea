"""A peer engine in a child process of its own venv, driven by one JSON line a job over
stdin/stdout (vllm_worker.py, llamacpp_worker.py): the engine loads once and takes turns with
pagedkv round by round; its stderr goes to a log whose end a failure shows."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


class JsonLinesChild:
    name = "the child"
    hint = ""  # what to try, added to a failure's message

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        env=env, text=True)
        self.ready = self.reply("did not start")  # the first line the child writes once loaded

    def ask(self, job: dict, what: str = "stopped mid-run") -> dict:
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        return self.reply(what)

    def reply(self, what: str) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.fail(what)
        return json.loads(line)

    def fail(self, what: str) -> None:
        tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"{self.name} {what} (exit status {self.process.poll()}){self.hint}; the end of its log:\n"
                         + "\n".join(tail))

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
