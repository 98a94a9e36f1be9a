"""Launch a RunSpec on GPUs with `accelerate launch` (DeepSpeed ZeRO-3, FSDP2, DDP or one GPU) and, in vLLM
server mode, a `vllm serve` process on its own GPUs, the way TRL 1.16 expects.

Three layouts (see docs/gpu.md):
- **hf**: `use_vllm=False`: every GPU trains and generates with HF generate (`sage launch --preset tiny-cpu`).
- **colocate**: every GPU trains and runs its own vLLM engine (`use_vllm=True, vllm_mode="colocate"`).
- **server**: `vllm serve` on GPU 0 (or the first `server_gpus` GPUs, tensor parallel), training on the rest;
  the trainer reaches the server at `vllm_server_base_url` and pushes weights over NCCL (port 51216).

`accelerate` and `vllm` come from `$SAGE_TRAIN_VENV` when it is set: the flows' venv (Prefect) cannot hold vLLM
0.31 (fastapi pins), so the GPU stack lives in a venv of its own (docs/gpu.md, Install).

Nothing here imports torch or vllm at module import; the command builders are pure functions so they are
unit-tested on CPU (tests/test_launch.py). `launch()` runs the commands as subprocesses and streams their logs;
the Prefect flows call it for the GPU presets.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .spec import RunSpec, layout_error

logger = logging.getLogger(__name__)

AccelerateConfig = Literal["zero3", "fsdp", "multi_gpu", "single_gpu"]
ACCELERATE_CONFIGS: tuple[str, ...] = ("zero3", "fsdp", "multi_gpu", "single_gpu")
GpuId = int | str  # a CUDA_VISIBLE_DEVICES entry: an index, or a GPU UUID ("GPU-...")

# vLLM flags TRL 1.16's server client relies on (trl/scripts/vllm_serve.py::build_command): the NCCL
# weight-transfer engine, log-probs after temperature (importance-sampling correction), no cap on logprobs.
TRL_VLLM_SERVER_FLAGS: tuple[str, ...] = (
    "--weight-transfer-config", json.dumps({"backend": "nccl"}),
    "--logprobs-mode", "processed_logprobs",
    "--max-logprobs", "-1",
)
DEFAULT_SERVER_PORT = 8000  # `vllm serve --port` when neither --port nor the launch's URL gives one
VLLM_GROUP_PORT = 51216  # TRL's default `vllm_group_port` (NCCL weight transfer); must be free on the host
RESULT_FILE = "train_result.json"  # written by `sage train` (sage_core.cli) in the output dir


def config_dir() -> Path:
    """Folder holding the accelerate YAMLs: $SAGE_ACCELERATE_CONFIG_DIR, else `configs/accelerate` of the source
    checkout this module lives in, else of the current directory."""
    env = os.environ.get("SAGE_ACCELERATE_CONFIG_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
    if here.is_dir():
        return here
    return Path.cwd() / "configs" / "accelerate"


def config_path(config: str) -> Path:
    if config not in ACCELERATE_CONFIGS:
        raise ValueError(f"unknown accelerate config {config!r}; choose one of {list(ACCELERATE_CONFIGS)}")
    return config_dir() / f"{config}.yaml"


def check_divisible(spec: RunSpec, num_processes: int) -> None:
    """Every rank must get the same rows, whole prompt groups, in micro-batches that split evenly
    (`spec.layout_error`, the rule each rank's trainer checks again): refused here, before anything starts."""
    if (why := layout_error(spec, num_processes)) is not None:
        raise ValueError(f"{why}; choose prompts_per_step so that prompts_per_step x num_generations is a multiple "
                         f"of {num_processes} (and micro_batch_size, updates_per_generation split each process's rows)")


def default_config(num_processes: int) -> str:
    """single_gpu for one process, ZeRO-3 otherwise (the paper's 8-GPU setting)."""
    return "single_gpu" if num_processes == 1 else "zero3"


TRAIN_VENV_ENV = "SAGE_TRAIN_VENV"  # the trainer venv (`.[gpu]`: accelerate, vllm) when it is not this one


def train_venv() -> Path | None:
    """`$SAGE_TRAIN_VENV`: the venv the ranks and `vllm serve` run from, when the caller (the Prefect worker's
    `.[app]` venv) cannot hold vLLM (docs/gpu.md, Install). None when unset."""
    venv = os.environ.get(TRAIN_VENV_ENV)
    return Path(venv).expanduser() if venv else None


def _venv_script(name: str) -> str:
    """The console script `name` (`accelerate`, `vllm`) that the ranks and the server run.

    `$SAGE_TRAIN_VENV` set: `$SAGE_TRAIN_VENV/bin/<name>`, and an error naming that path when it is not an
    executable file (no fallback: another venv's vLLM or accelerate would be the wrong one). Unset: the script
    next to this interpreter (a Prefect worker's PATH may not have its venv's bin), else PATH, else the name."""
    venv = train_venv()
    if venv is not None:
        path = venv / "bin" / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(
                f"{TRAIN_VENV_ENV}={os.environ[TRAIN_VENV_ENV]}: no executable {path}; build the trainer venv "
                f"(`make gpu-venv`: pip install -e '.[gpu]'), or unset {TRAIN_VENV_ENV} to run this interpreter's "
                f"`{name}`")
        return str(path)
    here = Path(sys.executable).with_name(name)
    if here.exists():
        return str(here)
    return shutil.which(name) or name


def _with_train_venv(env: dict[str, str]) -> dict[str, str]:
    """`env` as an activated `$SAGE_TRAIN_VENV` would have it (its bin first on PATH, VIRTUAL_ENV), so what the
    ranks and the server start by name (DeepSpeed's JIT calls `ninja`) comes from the trainer venv too."""
    venv = train_venv()
    if venv is None:
        return env
    path = env.get("PATH")
    return {**env, "VIRTUAL_ENV": str(venv),
            "PATH": str(venv / "bin") + (os.pathsep + path if path else "")}


def accelerate_command(spec: RunSpec, *, config: str = "zero3", num_processes: int, spec_path: str | os.PathLike,
                       output_dir: str | os.PathLike, main_process_port: int | None = None,
                       extra_args: Sequence[str] = ()) -> list[str]:
    """`accelerate launch --config_file configs/accelerate/<config>.yaml --num_processes N -m sage_core.cli train
    --spec SPEC --output-dir DIR`. `spec` is only used to check the batch split; the ranks read `spec_path`."""
    path = config_path(config)
    if config == "single_gpu" and num_processes != 1:
        raise ValueError(f"config 'single_gpu' runs one process, got num_processes={num_processes}; "
                         "use 'zero3', 'fsdp' or 'multi_gpu'")
    check_divisible(spec, num_processes)
    # the configs say bf16, and accelerate exports it to the ranks, where only bf16=True/fp16=True overrides it:
    # bf16=False would still train in bf16 without this flag
    precision = "no" if spec.bf16 is False else "bf16"
    cmd = [_venv_script("accelerate"), "launch", "--config_file", str(path), "--num_processes", str(num_processes),
           "--mixed_precision", precision]
    if main_process_port is not None:
        cmd += ["--main_process_port", str(main_process_port)]
    cmd += ["-m", "sage_core.cli", "train", "--spec", str(spec_path), "--output-dir", str(output_dir),
            *extra_args]
    return cmd


def vllm_server_command(model: str, tp: int = 1, port: int = 8000, gpu_mem: float = 0.9, *, host: str = "0.0.0.0",
                        max_model_len: int | None = None, dtype: str = "auto",
                        extra_args: Sequence[str] = ()) -> list[str]:
    """`vllm serve MODEL ...` with the flags TRL 1.16's VLLMClient needs. Run it with `vllm_server_env(...)`
    (VLLM_SERVER_DEV_MODE=1 exposes the weight-transfer and prefix-cache endpoints). `vllm` is the trainer
    venv's script (`_venv_script`), as for `accelerate`."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if not 0.0 < gpu_mem <= 1.0:
        raise ValueError(f"gpu_mem must be in (0, 1], got {gpu_mem}")
    cmd = [_venv_script("vllm"), "serve", model, "--host", host, "--port", str(port),
           "--tensor-parallel-size", str(tp), "--data-parallel-size", "1", "--gpu-memory-utilization", str(gpu_mem),
           "--dtype", dtype]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(TRL_VLLM_SERVER_FLAGS) + list(extra_args)


def vllm_server_env(gpus: Sequence[GpuId], base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env


@dataclass(frozen=True)
class GpuLayout:
    """Which GPUs train and which serve vLLM. `mode` is 'colocate', 'server' or 'hf' (no vLLM: transformers
    generate on the training GPUs). GPU ids are physical indices (before CUDA_VISIBLE_DEVICES remapping)."""

    mode: Literal["colocate", "server", "hf"]
    train_gpus: tuple[GpuId, ...]
    server_gpus: tuple[GpuId, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def num_processes(self) -> int:
        return len(self.train_gpus)

    @property
    def server_tp(self) -> int:
        return len(self.server_gpus)

    def describe(self) -> str:
        s = f"{self.mode}: train on GPU {list(self.train_gpus)} ({self.num_processes} process(es))"
        if self.server_gpus:
            s += f", vllm serve on GPU {list(self.server_gpus)} (tp={self.server_tp})"
        return s + "".join(f"; {n}" for n in self.notes)


def plan_layout(spec: RunSpec, n_gpus: int, *, vllm_mode: str | None = None, server_gpus: int = 1,
                gpu_ids: Sequence[GpuId] | None = None) -> GpuLayout:
    """Decide the layout for `n_gpus` GPUs.

    - no vLLM, or colocate: all GPUs train (colocate: each rank also hosts a vLLM engine).
    - server: `server_gpus` GPUs (tensor parallel) serve, the rest train. When the per-step completions do not
      split evenly over the remaining GPUs, the largest count that does is used and the rest stay idle (noted);
      e.g. 8 GPUs, 1 server, 128 prompts x 8 = 1024 completions: 7 trainers do not divide 1024, so 4 train.
      Choose prompts_per_step as a multiple of 7 (e.g. 112) to use all 7.
    """
    ids = tuple(gpu_ids) if gpu_ids is not None else tuple(range(n_gpus))
    if len(ids) != n_gpus:
        raise ValueError(f"gpu_ids {list(ids)} do not match n_gpus={n_gpus}")
    if n_gpus < 1:
        raise ValueError("no CUDA GPU visible: sage_core.launch is for GPU runs; on CPU run `sage train` directly")
    mode = (vllm_mode or spec.vllm_mode) if spec.use_vllm else "hf"
    if mode not in ("colocate", "server", "hf"):
        raise ValueError(f"unknown vllm mode {mode!r}")
    if mode != "server":
        check_divisible(spec, n_gpus)
        return GpuLayout(mode=mode, train_gpus=ids)
    if server_gpus < 1:
        raise ValueError(f"server_gpus must be >= 1, got {server_gpus}")
    if n_gpus < server_gpus + 1:
        raise ValueError(f"vLLM server mode needs at least {server_gpus + 1} GPUs ({server_gpus} for the server, "
                         f"1 to train), found {n_gpus}; use vllm_mode='colocate' on a single GPU")
    serve, rest = ids[:server_gpus], ids[server_gpus:]
    fits = [d for d in range(1, len(rest) + 1) if layout_error(spec, d) is None]
    if not fits:
        raise ValueError(f"{layout_error(spec, 1)}: no count of trainers up to {len(rest)} fits")
    k = max(fits)
    notes: tuple[str, ...] = ()
    if k < len(rest):
        note = (f"{len(rest)} trainers do not fit ({layout_error(spec, len(rest))}): using {k}, GPU "
                f"{list(rest[k:])} idle (set prompts_per_step so that prompts_per_step x num_generations is a "
                f"multiple of {len(rest)})")
        notes = (note,)
    return GpuLayout(mode="server", train_gpus=rest[:k], server_gpus=serve, notes=notes)


def visible_gpus() -> list[GpuId]:
    """The visible CUDA GPUs as CUDA_VISIBLE_DEVICES names them (indices, or GPU UUIDs as some container runtimes
    set), else torch's device indices, else nvidia-smi's. The launcher hands subsets of these back through
    CUDA_VISIBLE_DEVICES, so they are kept as given. As CUDA reads that variable, an entry that is neither an index
    nor a UUID (GPU-..., MIG-...) ends the list: `-1` hides every GPU, `0,2,-1,1` shows 0 and 2."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids: list[GpuId] = []
        for x in (x.strip() for x in env.split(",")):
            if x.isdigit():
                ids.append(int(x))
            elif x.startswith(("GPU-", "MIG-")):
                ids.append(x)
            elif x:  # CUDA sees no GPU from here on
                break
        return ids
    try:
        import torch

        if torch.cuda.is_available():
            return list(range(torch.cuda.device_count()))
        return []
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False).stdout
    return [i for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


@dataclass
class LaunchPlan:
    """Everything `launch()` will run, for printing (`sage launch --dry-run`) and for tests."""

    layout: GpuLayout
    spec: RunSpec
    spec_path: Path
    output_dir: Path
    train_cmd: list[str]
    train_env: dict[str, str] = field(repr=False)
    server_cmd: list[str] | None = None
    server_env: dict[str, str] | None = field(default=None, repr=False)
    server_url: str | None = None
    train_venv: Path | None = None  # $SAGE_TRAIN_VENV when the plan was made: both commands run activated in it

    def shell(self) -> str:
        """The plan as shell lines a person can paste, run as launch() runs them: with $SAGE_TRAIN_VENV set, its
        bin first on the PATH of the shell they are pasted in, and VIRTUAL_ENV (_with_train_venv)."""
        import shlex

        venv = ""
        if self.train_venv is not None:
            venv = (f"VIRTUAL_ENV={shlex.quote(str(self.train_venv))} "
                    f"PATH={shlex.quote(str(self.train_venv / 'bin'))}:\"$PATH\" ")
        lines = []
        if self.server_cmd:
            lines.append(f"{venv}CUDA_VISIBLE_DEVICES={','.join(map(str, self.layout.server_gpus))} "
                         f"VLLM_SERVER_DEV_MODE=1 {shlex.join(self.server_cmd)} &")
        lines.append(f"{venv}CUDA_VISIBLE_DEVICES={','.join(map(str, self.layout.train_gpus))} "
                     f"{shlex.join(self.train_cmd)}")
        return "\n".join(lines)

    def write_spec(self) -> None:
        """Write the spec file the train command reads (launch() does before it runs; a dry run too, so the printed
        commands run as they are)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.spec_path.write_text(self.spec.model_dump_json(indent=2))


def server_address(server_url: str | None, port: int | None = None) -> tuple[str, str, int]:
    """(URL the trainers use, host `vllm serve` binds, its port) for the server a launch starts.

    No `server_url`: `http://127.0.0.1:<port>` (8000 when `port` is None), bound to loopback (the trainers run on
    this node). A URL given for this launch (`sage launch --set vllm_server_base_url=http://host:8000`, for ranks on
    other nodes) is kept, and the server listens where it points: on the URL's port, bound to 0.0.0.0 (every
    interface; `::` for an IPv6 address) unless its host is a loopback one (then that address, 127.0.0.1 for
    localhost). ValueError when the URL is not `http(s)://host:port`, or its port is not `port`."""
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"--port {port}: a TCP port is 1 to 65535")
    if server_url is None:
        port = DEFAULT_SERVER_PORT if port is None else port
        return f"http://127.0.0.1:{port}", "127.0.0.1", port
    shape = (f"vllm_server_base_url {server_url!r}: give the server's address as http://HOST:PORT "
             "(e.g. http://node0:8000)")
    try:
        u = urllib.parse.urlsplit(server_url)
        url_port = u.port
    except ValueError as e:  # a port that is no number, or out of range
        raise ValueError(f"{shape}; {e}") from None
    if u.scheme not in ("http", "https") or not u.hostname or url_port is None:
        raise ValueError(shape)
    if u.path not in ("", "/") or u.query or u.fragment or u.username is not None or u.password is not None:
        raise ValueError(f"{shape}, with no path, query or user (TRL adds its own paths to it)")
    host = u.hostname
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_unspecified:
        raise ValueError(f"{shape}: {host} is an address to listen on, not one the trainers can reach; give this "
                         "node's name or IP")
    if port is not None and port != url_port:
        raise ValueError(f"--port {port} and vllm_server_base_url {server_url!r} (port {url_port}) disagree: the "
                         f"server listens on one port; drop --port or give the URL port {port}")
    if host.lower() == "localhost":
        bind = "127.0.0.1"
    elif ip is not None and ip.is_loopback:
        bind = host
    else:
        bind = "::" if ip is not None and ip.version == 6 else "0.0.0.0"
    return server_url, bind, url_port


def plan(spec: RunSpec, output_dir: str | os.PathLike, *, gpus: Sequence[GpuId] | None = None,
         config: str | None = None, vllm_mode: str | None = None, server_gpus: int = 1, port: int | None = None,
         server_gpu_mem: float = 0.9, main_process_port: int | None = None,
         env: Mapping[str, str] | None = None, mlflow_run_id: str | None = None,
         server_url: str | None = None) -> LaunchPlan:
    """Build the commands without running anything. `gpus` defaults to the visible GPUs. With `mlflow_run_id`
    the ranks log into that MLflow run (SAGE_MLFLOW_RUN_ID, read by sage_core.tracking.callback_from_env). With
    `$SAGE_TRAIN_VENV` set, `accelerate` and `vllm` are that venv's scripts and both run with its bin first on
    PATH (FileNotFoundError, naming the path, when it lacks one).

    Server mode: the trainers use the server this launch starts, whatever URL the spec carries (an earlier
    launch's): `http://127.0.0.1:<port>` (port 8000 by default), unless `server_url` gives the address for this
    launch (the user's own `--set vllm_server_base_url`): then that URL is kept and the server listens there
    (`server_address`; ValueError when it is no http(s)://host:port or contradicts `port`)."""
    ids = list(gpus) if gpus is not None else visible_gpus()
    layout = plan_layout(spec, len(ids), vllm_mode=vllm_mode, server_gpus=server_gpus, gpu_ids=ids)
    out = Path(output_dir).resolve()
    bind_host, bind_port = "127.0.0.1", DEFAULT_SERVER_PORT
    if layout.mode == "server":
        server_url, bind_host, bind_port = server_address(server_url, port)
    else:
        server_url = None  # no server: the URL is not used, nor checked
    updates: dict[str, object] = {}
    if spec.use_vllm:
        updates["vllm_mode"] = layout.mode
    if server_url:  # the server this launch starts, whatever URL an earlier launch's spec carried
        updates["vllm_server_base_url"] = server_url
    run_spec = spec.model_copy(update=updates) if updates else spec
    run_spec = RunSpec.model_validate(run_spec.model_dump())  # re-validate after the update
    spec_path = out / "launch_spec.json"
    cfg = config or default_config(layout.num_processes)
    train_cmd = accelerate_command(run_spec, config=cfg, num_processes=layout.num_processes, spec_path=spec_path,
                                   output_dir=out, main_process_port=main_process_port)
    base = _with_train_venv(dict(os.environ if env is None else env))
    train_env = {**base, "CUDA_VISIBLE_DEVICES": ",".join(map(str, layout.train_gpus))}
    if mlflow_run_id:
        train_env.update(SAGE_MLFLOW_RUN_ID=mlflow_run_id, SAGE_OUTPUT_DIR=str(out))
    server_cmd = server_env = None
    if layout.mode == "server":
        # loopback unless this launch's URL names another host (ranks on other nodes reach it there)
        server_cmd = vllm_server_command(served_model(spec), tp=layout.server_tp, port=bind_port,
                                         gpu_mem=server_gpu_mem, host=bind_host, max_model_len=_max_model_len(spec))
        server_env = vllm_server_env(layout.server_gpus, base)
    return LaunchPlan(layout=layout, spec=run_spec, spec_path=spec_path, output_dir=out, train_cmd=train_cmd,
                      train_env=train_env, server_cmd=server_cmd, server_env=server_env,
                      server_url=run_spec.vllm_server_base_url if layout.mode == "server" else None,
                      train_venv=train_venv())


def served_model(spec: RunSpec) -> str:
    """What `vllm serve` loads for the spec's model: the tiny model's folder (it is a name only to this project), or
    the path or HF id as given. GGUF files and LoRA adapter folders (checkpoint-N/, adapter/) are refused: serve a
    full model (a LoRA run's final/ is the merged one) or use colocate mode."""
    from .lora import adapter_base
    from .models import resolve_model_path

    if spec.gguf_file or spec.model == "smollm2" or spec.model.endswith(".gguf"):
        raise ValueError(f"model {spec.model!r} is a GGUF file: vLLM server mode serves full-precision HF models "
                         "here; use vllm_mode=colocate or a HF model")
    if adapter_base(spec.model) is not None:
        raise ValueError(f"{spec.model} holds LoRA adapters, not a model vllm serve can load: point model at the "
                         "run's final/ (the merged model) or use vllm_mode=colocate")
    return resolve_model_path(spec.model)


def _max_model_len(spec: RunSpec) -> int | None:
    """Longest sequence the server must hold: prompt + hint (SAGE's hinted prompt is longer) + completion, plus
    256 tokens for the hint template's own words. None (the model's own limit) when the prompt length is open."""
    if spec.max_prompt_length is None:
        return None
    return spec.max_prompt_length + spec.hint_max_tokens + 256 + spec.max_completion_length


@dataclass
class LaunchResult:
    returncode: int
    plan: LaunchPlan
    log_path: Path
    result: dict | None  # the TrainResult `sage train` wrote (train_result.json), None if it failed
    tail: list[str]

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _pump(stream, sink: Callable[[str], None], fh, tail: deque | None) -> None:
    """Copy a child's output to its log file, `tail` and `sink` until the child closes it. A sink that fails is not
    called again, but the output is still read: a child whose pipe nobody reads blocks once it holds 64 KB."""
    for line in iter(stream.readline, ""):
        line = line.rstrip("\n")
        fh.write(line + "\n")
        fh.flush()
        if tail is not None:
            tail.append(line)
        if sink is not None:
            try:
                sink(line)
            except Exception as e:  # noqa: BLE001 - the log file still gets every line
                logger.warning("launch: a log line could not be passed on (%s: %s); the rest go to %s only",
                               type(e).__name__, e, getattr(fh, "name", "the log file"))
                sink = None
    stream.close()


def _wait(proc: subprocess.Popen, poll: float = 1.0) -> int:
    """proc.wait() that a stop (Ctrl-C, SIGTERM raised as an exception) interrupts within `poll` seconds: a signal
    that lands on another thread does not wake a blocking waitpid in the main thread."""
    while True:
        try:
            return proc.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            pass


def wait_for_server(url: str, timeout: float = 900.0, proc: subprocess.Popen | None = None,
                    interval: float = 5.0) -> None:
    """Poll `url`/health until it answers 200; raise if `proc` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(interval)
    raise TimeoutError(f"vllm serve at {url} not healthy after {timeout:.0f}s")


def _stop(proc: subprocess.Popen | None, what: str, log: Callable[[str], None], timeout: float = 60.0) -> None:
    """SIGTERM to a child still running (accelerate's agent passes it on to the ranks; vllm serve shuts down), SIGKILL
    after `timeout`."""
    if proc is None or proc.poll() is not None:
        return
    log(f"[sage.launch] stopping {what} (pid {proc.pid})")
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def launch(spec: RunSpec, output_dir: str | os.PathLike, *, gpus: Sequence[GpuId] | None = None,
           config: str | None = None, vllm_mode: str | None = None, server_gpus: int = 1, port: int | None = None,
           server_gpu_mem: float = 0.9, main_process_port: int | None = None,
           log: Callable[[str], None] = print, server_timeout: float = 900.0, check: bool = True,
           env: Mapping[str, str] | None = None, mlflow_run_id: str | None = None,
           server_url: str | None = None) -> LaunchResult:
    """Run `spec` on the GPUs: start `vllm serve` first in server mode (and wait for /health), then
    `accelerate launch ... -m sage_core.cli train`. Every output line goes to `log` (the flows pass their Prefect
    logger) and to `<output_dir>/launch.log` (the server's to `vllm_server.log`). Returns the exit code and the
    TrainResult dict the ranks wrote; with `check=True` a non-zero exit raises RuntimeError with the log tail.
    `mlflow_run_id`: an MLflow run the caller opened (and closes); the ranks log metrics and artifacts into it.
    `port`, `server_url`: where the vLLM server listens, as for `plan`."""
    p = plan(spec, output_dir, gpus=gpus, config=config, vllm_mode=vllm_mode, server_gpus=server_gpus, port=port,
             server_gpu_mem=server_gpu_mem, main_process_port=main_process_port, env=env,
             mlflow_run_id=mlflow_run_id, server_url=server_url)
    p.write_spec()
    (p.output_dir / RESULT_FILE).unlink(missing_ok=True)
    log(f"[sage.launch] layout {p.layout.describe()}")
    log_path = p.output_dir / "launch.log"
    server = proc = reader = None
    threads: list[threading.Thread] = []
    tail: deque[str] = deque(maxlen=60)
    files = contextlib.ExitStack()
    try:
        if p.server_cmd is not None:
            log(f"[sage.launch] starting: {' '.join(p.server_cmd)}")
            server_fh = files.enter_context(open(p.output_dir / "vllm_server.log", "a"))  # noqa: SIM115
            server = subprocess.Popen(p.server_cmd, env=p.server_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1)
            t = threading.Thread(target=_pump, args=(server.stdout, lambda s: log(f"[vllm] {s}"), server_fh, None),
                                 daemon=True)
            t.start()
            threads.append(t)
            wait_for_server(p.server_url, server_timeout, server)
            log(f"[sage.launch] vllm serve healthy at {p.server_url}")
        log(f"[sage.launch] running: {' '.join(p.train_cmd)}")
        fh = files.enter_context(open(log_path, "a"))  # noqa: SIM115
        proc = subprocess.Popen(p.train_cmd, env=p.train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, cwd=str(Path.cwd()))
        # read on a thread of its own, so that the ranks' output is still read while they stop (the finally below)
        reader = threading.Thread(target=_pump, args=(proc.stdout, log, fh, tail), daemon=True)
        reader.start()
        rc = _wait(proc)
        reader.join()
    finally:
        # stopped (Ctrl-C, or SIGTERM raised as an exception by `sage launch`; a SIGTERM to this process alone does
        # not reach the ranks): the ranks are stopped first, while the server they use is still up
        _stop(proc, "the training processes", log)
        if reader is not None:
            reader.join(timeout=30)  # the ranks' last lines (why they stopped) into the log
        _stop(server, "vllm serve", log)
        for t in threads:
            t.join(timeout=5)
        files.close()
    result = None
    rfile = p.output_dir / RESULT_FILE
    if rc == 0 and rfile.exists():
        result = json.loads(rfile.read_text())
    out = LaunchResult(returncode=rc, plan=p, log_path=log_path, result=result, tail=list(tail))
    if check and rc != 0:
        raise RuntimeError(f"accelerate launch exited with code {rc}; last lines of {log_path}:\n"
                           + "\n".join(list(tail)[-20:]))
    return out
