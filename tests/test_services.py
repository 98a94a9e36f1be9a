"""flows/services.sh (make up/down) against stand-in programs: `BIN` holds a `prefect`, `mlflow` and `python` that
only sleep (servers), answer health checks, print serve's start lines and know the deployments served."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from helpers import free_port

SCRIPT = Path(__file__).parent.parent / "flows" / "services.sh"
FAKE = r"""#!/usr/bin/env bash
case "$(basename "$0") $1 $2" in
  "python - "*) exit 0 ;;                                       # wait_http's health check
  "python -m flows.serve")                                      # serve: what flows/serve.py prints, then serve
    echo "serving: sage-train/tiny-cpu"; echo "sage-train/tiny-cpu" > "$SAGE_HOME/served"
    echo "Your deployments are being served and polling for scheduled runs!"; exec sleep 600 ;;
  "prefect deployment inspect") sleep "${INSPECT_SECONDS:-0}"; grep -qx "$3" "$SAGE_HOME/served" ;;
  *) exec sleep 600 ;;                                          # prefect server start, mlflow server
esac
"""


def services(tmp_path: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    bin_ = tmp_path / "bin"
    if not bin_.is_dir():
        bin_.mkdir()
        for name in ("prefect", "mlflow", "python"):
            (bin_ / name).write_text(FAKE)
            (bin_ / name).chmod(0o755)
    full = {**os.environ, "BIN": str(bin_), "SAGE_HOME": str(tmp_path / "home"), "PREFECT_PORT": str(free_port()),
            "MLFLOW_PORT": str(free_port()), "SERVICES_TIMEOUT": "20", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_up_waits_for_what_serve_serves(tmp_path):
    """SERVE_ARGS that leave hint-study out: `up` waits for a deployment serve serves, not for hint-study/tiny-cpu
    (which would never come)."""
    try:
        up = services(tmp_path, "up", SERVE_ARGS="--only sage-train --preset tiny-cpu")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "deployment sage-train/tiny-cpu ready" in up.stdout
    finally:
        services(tmp_path, "down")


def test_services_timeout_counts_seconds(tmp_path):
    """SERVICES_TIMEOUT is seconds of waiting, also where each check takes time (a `prefect` CLI call: seconds)."""
    try:
        t0 = time.monotonic()
        up = services(tmp_path, "up", WAIT_DEPLOYMENT="hint-study/tiny-cpu", SERVICES_TIMEOUT="10", INSPECT_SECONDS="8")
        took = time.monotonic() - t0
        assert up.returncode == 1 and "not registered after 10s" in up.stdout
        assert took < 10 + 8 + 2 + 5, took  # the timeout, one check, one pause, start-up; not 5 checks of 10 s
    finally:
        services(tmp_path, "down")


def test_a_stale_pid_file_names_no_process_of_ours(tmp_path):
    """A pid file left behind (a reboot, a crash) whose pid another program has now: `status` does not take that
    program for the service, and `down` leaves it running."""
    import signal

    pidfile = tmp_path / "home" / "run" / "prefect.pid"
    ours = other = None
    try:
        up = services(tmp_path, "up", WAIT_DEPLOYMENT="sage-train/tiny-cpu")
        assert up.returncode == 0, up.stdout + up.stderr
        time.sleep(1.1)  # a later second: what a process started after ours shows
        other = subprocess.Popen(["sleep", "600"], start_new_session=True)
        lines = pidfile.read_text().splitlines()
        ours = int(lines[0])
        pidfile.write_text("\n".join([str(other.pid), *lines[1:]]) + "\n")  # the pid is another program's now
        assert "prefect not running" in services(tmp_path, "status").stdout
        services(tmp_path, "down")
        assert other.poll() is None, "down stopped a process it did not start"
    finally:
        services(tmp_path, "down")
        if ours is not None:
            os.killpg(ours, signal.SIGKILL)
        if other is not None:
            other.kill()
            other.wait()
