"""Run many ``python launch.py ...`` command lines without paying Python's imports for each: a warm parent process.

The parent is a fresh interpreter that imports what ``launch.py`` imports (torch, transformers, Hydra, streakline's
stages) and runs nothing else, so it holds no threads and no torch state. For each command line it forks a child,
which sets the environment, the working directory and ``sys.argv``, sends its standard output and error to files,
runs ``launch.py`` as ``__main__`` and exits with its status. The child is one process running the real entry
point from its start, like ``subprocess.run([sys.executable, "launch.py", ...])``, less the 3-5 s of imports
(import-time reads of the environment are the parent's; streakline reads its own variables when it runs). A test
that must see a cold start runs ``launch.py`` in a plain subprocess instead.

    with WarmLauncher(cwd=ROOT) as launcher:
        done = launcher.run(["model=micro", "stage=decode", ...], env={...})   # Completed(returncode, stdout, stderr)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The parent's loop: a JSON request a line on stdin, a JSON answer a line on stdout. Kept as source text because the
# parent must be a fresh interpreter (a fork of the pytest process would inherit its torch threads).
_PARENT = r"""
import json, os, runpy, sys
answer = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # an import's print must not reach the answers
import torch, transformers, hydra, omegaconf
import streakline.cli, streakline.pipelines, streakline.world, streakline.models, streakline.decoding
sys.stdout.flush(); sys.stderr.flush()  # nothing of the parent's may end up in a child's files
answer.write("ready\n"); answer.flush()
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.chdir(req["cwd"])
            os.environ.clear(); os.environ.update(req["env"])
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests come on stdin: not the child's to read
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = [req["script"], *req["args"]]
            try:
                runpy.run_path(req["script"], run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, int | None):
                    print(stop.code, file=sys.stderr)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    answer.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n"); answer.flush()
"""


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


class WarmLauncher:
    """A warm parent for ``launch.py`` command lines (see the module docstring); one command at a time."""

    def __init__(self, cwd: Path = ROOT, script: str = "launch.py"):
        self.cwd, self.script = Path(cwd), str(Path(cwd) / script)
        self.tmp = tempfile.TemporaryDirectory(prefix="warm-launcher-")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PARENT], cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm launcher did not start (status {self.proc.poll()})")

    def run(self, args: list[str], env: dict[str, str]) -> Completed:
        out, err = Path(self.tmp.name) / "stdout", Path(self.tmp.name) / "stderr"
        request = {"cwd": str(self.cwd), "env": env, "script": self.script, "args": list(args),
                   "stdout": str(out), "stderr": str(err)}  # fmt: skip
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # the timeout is pytest's (pyproject's timeout) for a hung child
        if not line:
            raise RuntimeError(f"the warm launcher died (status {self.proc.poll()})")
        code = json.loads(line)["returncode"]
        return Completed(code, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.tmp.cleanup()

    def __enter__(self) -> WarmLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
