"""A real Flower deployment on this machine: one SuperLink and n SuperNodes as separate processes that
talk over loopback HTTP, and ``flwr run`` submitting the dpopt Flower app to them.

The app bundle is written to ``DIR/flower-app`` (a ``pyproject.toml`` naming ``dpopt.federated.flower``'s
``server_app`` and ``client_app``, with the run's config); the Flower CLI's connection file to
``DIR/flower-home``; every process logs to ``DIR/flower-logs``. Each SuperNode gets
``partition-id``/``num-partitions`` and, if the run has one, the clients' ``secret-seed`` in its own node
config: the server never sees it (without one, each client draws its own key from OS entropy). The
processes are stopped when the run ends or fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from dpopt.federated.config import FederatedConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"a Flower process exited early (code {proc.returncode}); see {log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.5)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s; see {log}")


def write_app(config: FederatedConfig, out: Path) -> Path:
    """The Flower app bundle (its pyproject.toml) for this run."""
    import tomli_w

    app = out / "flower-app"
    app.mkdir(parents=True, exist_ok=True)
    (app / "dpopt_app.py").write_text('"""The components live in dpopt.federated.flower (see pyproject.toml)."""\n')
    (app / "pyproject.toml").write_text(tomli_w.dumps({
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": "dpopt-federated", "version": "1.0.0", "description": "dpopt federated run",
                    "license": "Apache-2.0", "dependencies": []},
        "tool": {"flwr": {"app": {
            "publisher": "dpopt",
            "components": {"serverapp": "dpopt.federated.flower:server_app",
                           "clientapp": "dpopt.federated.flower:client_app"},
            "config": {"dpopt-config": config.to_json(), "out": str(out.resolve())}}}}}))
    return app


@contextlib.contextmanager
def _processes() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:  # each was started in its own session: stop it with the children it spawned
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)


def run_deployment(config: FederatedConfig, out: str | Path, timeout: float = 3600.0,
                   secret_seed: int | None = None) -> dict:
    """Start a SuperLink and ``config.clients`` SuperNodes on loopback, run the app, return its metrics.
    ``secret_seed`` (replayable noise) goes to the SuperNodes' node configs only."""
    out = Path(out)
    logs, home = out / "flower-logs", out / "flower-home"
    logs.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").unlink(missing_ok=True)
    app = write_app(config, out)
    link = _free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "dpopt"\n\n[superlink.dpopt]\n'
                                      f'address = "127.0.0.1:{link}"\ninsecure = true\n')
    bin_dir = str(Path(sys.executable).parent)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p),
           "OMP_NUM_THREADS": "1"}

    def start(name: str, args: list[str]) -> subprocess.Popen:
        log = logs / f"{name}.log"
        return subprocess.Popen([str(Path(bin_dir) / args[0]), *args[1:]], stdout=log.open("w"),
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)

    with _processes() as procs:
        procs.append(start("superlink", ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
                                         "--port", str(link)]))
        _wait_for_port(link, procs[0], logs / "superlink.log")
        for i in range(config.clients):
            node = f"partition-id={i} num-partitions={config.clients}"
            if secret_seed is not None:
                node += f" secret-seed={secret_seed}"
            port = _free_port()
            procs.append(start(f"supernode-{i}", ["flower-supernode", "--insecure", "--superlink",
                                                  f"127.0.0.1:{link}", "--port", str(port), "--node-config", node]))
            _wait_for_port(port, procs[-1], logs / f"supernode-{i}.log")
        with (logs / "flwr-run.log").open("w") as log:
            subprocess.run([str(Path(bin_dir) / "flwr"), "run", str(app), "dpopt", "--stream"], stdout=log,
                           stderr=subprocess.STDOUT, env=env, timeout=timeout, check=True)
        deadline = time.monotonic() + 60
        while not (out / "metrics.json").is_file():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Flower run ended without metrics; see {logs}")
            time.sleep(0.5)
    return json.loads((out / "metrics.json").read_text())
