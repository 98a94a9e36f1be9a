"""sage_core.launch: accelerate / vllm serve command construction and GPU layouts (no GPU needed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sage_core import launch as L
from sage_core.presets import preset
from sage_core.spec import RunSpec

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = {"compute_environment", "distributed_type", "mixed_precision", "num_machines", "num_processes",
                 "machine_rank", "use_cpu"}


@pytest.fixture(autouse=True)
def _no_train_venv(monkeypatch):
    """The commands below are this interpreter's unless a test sets $SAGE_TRAIN_VENV itself."""
    monkeypatch.delenv(L.TRAIN_VENV_ENV, raising=False)


@pytest.mark.parametrize("name", L.ACCELERATE_CONFIGS)
def test_accelerate_yaml_loads_with_required_keys(name):
    path = L.config_path(name)
    assert path == ROOT / "configs" / "accelerate" / f"{name}.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert REQUIRED_KEYS <= set(cfg), REQUIRED_KEYS - set(cfg)
    assert cfg["compute_environment"] == "LOCAL_MACHINE" and cfg["use_cpu"] is False
    assert cfg["mixed_precision"] == "bf16"
    assert cfg.get("gpu_ids", "all") == "all", "a fixed gpu_ids would override launch's CUDA_VISIBLE_DEVICES"
    expected = {"zero3": "DEEPSPEED", "fsdp": "FSDP", "multi_gpu": "MULTI_GPU", "single_gpu": "NO"}[name]
    assert cfg["distributed_type"] == expected
    if name == "zero3":
        assert cfg["deepspeed_config"]["zero_stage"] == 3
        assert cfg["deepspeed_config"]["zero3_save_16bit_model"] is True
    if name == "fsdp":
        assert cfg["fsdp_config"]["fsdp_version"] == 2
        assert cfg["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    if name == "single_gpu":
        assert cfg["num_processes"] == 1


@pytest.mark.parametrize("name", L.ACCELERATE_CONFIGS)
def test_accelerate_yaml_is_accepted_by_accelerate(name):
    """accelerate's own loader parses the file into its config class (it rejects unknown keys)."""
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(L.config_path(name)))
    assert cfg.distributed_type.value == {"zero3": "DEEPSPEED", "fsdp": "FSDP", "multi_gpu": "MULTI_GPU",
                                          "single_gpu": "NO"}[name]


def test_accelerate_command_shape(tmp_path):
    spec = preset("qwen2.5-7b")
    cmd = L.accelerate_command(spec, config="zero3", num_processes=8, spec_path=tmp_path / "s.json",
                               output_dir=tmp_path / "out")
    assert Path(cmd[0]).name == "accelerate" and cmd[1] == "launch"
    assert cmd[cmd.index("--config_file") + 1] == str(ROOT / "configs" / "accelerate" / "zero3.yaml")
    assert cmd[cmd.index("--num_processes") + 1] == "8"
    i = cmd.index("-m")
    assert cmd[i:i + 3] == ["-m", "sage_core.cli", "train"]
    assert cmd[cmd.index("--spec") + 1] == str(tmp_path / "s.json")
    assert cmd[cmd.index("--output-dir") + 1] == str(tmp_path / "out")
    assert cmd.index("--num_processes") < i, "launcher flags must come before the module"
    port = L.accelerate_command(spec, config="fsdp", num_processes=4, spec_path="s", output_dir="o",
                                main_process_port=29555)
    assert port[port.index("--main_process_port") + 1] == "29555" and "fsdp.yaml" in port[3]


def test_accelerate_command_rejects_bad_input():
    spec = preset("qwen2.5-7b")
    with pytest.raises(ValueError, match="unknown accelerate config"):
        L.accelerate_command(spec, config="zero9", num_processes=8, spec_path="s", output_dir="o")
    with pytest.raises(ValueError, match="single_gpu"):
        L.accelerate_command(spec, config="single_gpu", num_processes=2, spec_path="s", output_dir="o")
    with pytest.raises(ValueError, match="multiple of 7"):
        L.accelerate_command(spec, config="zero3", num_processes=7, spec_path="s", output_dir="o")


def test_config_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_ACCELERATE_CONFIG_DIR", str(tmp_path))
    assert L.config_path("fsdp") == tmp_path / "fsdp.yaml"


def test_vllm_server_command_has_trl_flags():
    cmd = L.vllm_server_command("Qwen/Qwen2.5-7B-Instruct", tp=2, port=8001, gpu_mem=0.85, max_model_len=4096)
    assert Path(cmd[0]).name == "vllm" and cmd[1:3] == ["serve", "Qwen/Qwen2.5-7B-Instruct"]

    def flag(f):
        return cmd[cmd.index(f) + 1]

    assert flag("--tensor-parallel-size") == "2" and flag("--port") == "8001"
    assert flag("--gpu-memory-utilization") == "0.85" and flag("--max-model-len") == "4096"
    assert flag("--data-parallel-size") == "1"
    assert json.loads(flag("--weight-transfer-config")) == {"backend": "nccl"}
    assert flag("--logprobs-mode") == "processed_logprobs"
    assert flag("--max-logprobs") == "-1"
    env = L.vllm_server_env([0, 1], base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(ValueError):
        L.vllm_server_command("m", tp=0)
    with pytest.raises(ValueError):
        L.vllm_server_command("m", gpu_mem=1.5)


def test_vllm_flags_match_trl_build_command():
    """Our server flags are the ones TRL 1.16 itself imposes (trl/scripts/vllm_serve.py::build_command)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    trl_cmd = build_command(ScriptArguments(model="m"))
    i = trl_cmd.index("--weight-transfer-config")
    assert tuple(trl_cmd[i:i + 6]) == L.TRL_VLLM_SERVER_FLAGS


def test_layout_colocate_uses_all_gpus():
    spec = preset("qwen2.5-7b")
    lay = L.plan_layout(spec, 8)
    assert lay.mode == "colocate" and lay.train_gpus == tuple(range(8)) and lay.server_gpus == ()
    assert lay.num_processes == 8 and not lay.notes
    one = L.plan_layout(spec, 1)
    assert one.num_processes == 1 and L.default_config(one.num_processes) == "single_gpu"
    assert L.default_config(8) == "zero3"


def test_layout_server_gpu0_and_rest():
    spec = preset("qwen2.5-7b", prompts_per_step=112)  # 896 completions = 7 x 128
    lay = L.plan_layout(spec, 8, vllm_mode="server")
    assert lay.mode == "server" and lay.server_gpus == (0,) and lay.train_gpus == tuple(range(1, 8))
    assert lay.server_tp == 1 and not lay.notes
    tp2 = L.plan_layout(preset("qwen2.5-7b"), 8, vllm_mode="server", server_gpus=2)
    assert tp2.server_gpus == (0, 1) and tp2.train_gpus == (2, 3, 4, 5) and tp2.notes  # 1024 % 6 != 0 -> 4


def test_layout_server_uneven_batch_idles_gpus():
    lay = L.plan_layout(preset("qwen2.5-7b"), 8, vllm_mode="server")  # 1024 completions, 7 trainers
    assert lay.train_gpus == (1, 2, 3, 4) and "idle" in lay.notes[0] and "multiple of 7" in lay.notes[0]


def test_layout_errors():
    spec = preset("qwen2.5-7b")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        L.plan_layout(spec, 0)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        L.plan_layout(spec, 1, vllm_mode="server")
    with pytest.raises(ValueError, match="multiple of 3"):
        L.plan_layout(spec, 3)  # colocate: every GPU trains, 1024 % 3 != 0


def test_layout_without_vllm_and_physical_ids():
    spec = preset("tiny-cpu")
    assert not spec.use_vllm
    lay = L.plan_layout(spec, 2, vllm_mode="server", gpu_ids=[4, 6])
    assert lay.mode == "hf" and lay.train_gpus == (4, 6)


def test_plan_server_mode_rewrites_spec_and_envs(tmp_path):
    spec = preset("qwen2.5-7b", prompts_per_step=112)
    p = L.plan(spec, tmp_path, gpus=list(range(8)), vllm_mode="server", port=8123, env={"A": "1"})
    assert p.spec.vllm_mode == "server" and p.spec.vllm_server_base_url == "http://127.0.0.1:8123"
    assert p.server_env["CUDA_VISIBLE_DEVICES"] == "0" and p.server_env["VLLM_SERVER_DEV_MODE"] == "1"
    assert p.train_env["CUDA_VISIBLE_DEVICES"] == "1,2,3,4,5,6,7" and p.train_env["A"] == "1"
    assert p.server_cmd[p.server_cmd.index("--port") + 1] == "8123"
    assert p.server_cmd[p.server_cmd.index("--host") + 1] == "127.0.0.1"
    assert p.train_cmd[p.train_cmd.index("--num_processes") + 1] == "7"
    # prompt 2048 + hint 1024 + template margin 256 + completion 8192
    assert p.server_cmd[p.server_cmd.index("--max-model-len") + 1] == str(2048 + 1024 + 256 + 8192)
    shell = p.shell()
    assert shell.splitlines()[0].startswith(f"CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 {p.server_cmd[0]} serve")
    assert "'{\"backend\": \"nccl\"}'" in shell


def test_plan_serves_its_own_server_the_models_folder_and_refuses_what_vllm_cannot_serve(tmp_path, tiny_model_dir):
    """The server launch starts is the one the trainers use, even when the spec carries an earlier launch's URL;
    `vllm serve` gets the tiny model's folder (a name only this project knows), never a GGUF or adapters."""
    spec = preset("qwen2.5-7b", prompts_per_step=112, vllm_server_base_url="http://127.0.0.1:8000")
    p = L.plan(spec, tmp_path, gpus=list(range(8)), vllm_mode="server", port=8001)
    assert p.server_url == p.spec.vllm_server_base_url == "http://127.0.0.1:8001"
    tiny = preset("tiny-cpu", use_vllm=True, vllm_mode="server", prompts_per_step=4)
    p = L.plan(tiny, tmp_path, gpus=[0, 1])
    assert p.server_cmd[p.server_cmd.index("serve") + 1] == str(tiny_model_dir)
    adapters = tmp_path / "checkpoint-3"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    for model, says in (("smollm2", "GGUF"), (str(tmp_path / "m.gguf"), "GGUF"), (str(adapters), "LoRA adapters")):
        with pytest.raises(ValueError, match=says):
            L.plan(tiny.model_copy(update={"model": model}), tmp_path, gpus=[0, 1])


def _dry_run(tmp_path, *argv):
    from sage_core import cli

    out = tmp_path / "run"
    rc = cli.main(["launch", "--preset", "qwen2.5-7b", "--set", "prompts_per_step=112", "--gpus", "8",
                   "--vllm-mode", "server", "--dry-run", "--output-dir", str(out), *argv])
    return rc, out / "launch_spec.json"


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_a_server_url_given_to_sage_launch_is_kept_and_the_server_listens_there(tmp_path, capsys):
    """docs/gpu.md, Several nodes: `sage launch --set vllm_server_base_url=http://<host>:8000 --dry-run` writes the
    spec every node's ranks read; the URL must stay in it (not become this node's loopback), and `vllm serve` must
    listen on every interface at the URL's port, where the other nodes reach it."""
    rc, spec_file = _dry_run(tmp_path, "--set", "vllm_server_base_url=http://node0:8123")
    printed = capsys.readouterr().out
    assert rc == 0
    assert json.loads(spec_file.read_text())["vllm_server_base_url"] == "http://node0:8123"
    assert "--host 0.0.0.0 --port 8123" in printed
    rc, spec_file = _dry_run(tmp_path, "--set", "vllm_server_base_url=http://10.0.0.5:8001", "--port", "8001")
    assert rc == 0 and json.loads(spec_file.read_text())["vllm_server_base_url"] == "http://10.0.0.5:8001"
    assert "--host 0.0.0.0 --port 8001" in capsys.readouterr().out
    # from Python: plan(server_url=...) the same; a loopback URL stays on loopback, on its own port
    spec = preset("qwen2.5-7b", prompts_per_step=112)
    p = L.plan(spec, tmp_path, gpus=list(range(8)), vllm_mode="server", server_url="http://gpu-a.cluster:9000")
    assert p.server_url == p.spec.vllm_server_base_url == "http://gpu-a.cluster:9000"
    assert (_flag(p.server_cmd, "--host"), _flag(p.server_cmd, "--port")) == ("0.0.0.0", "9000")
    p = L.plan(spec, tmp_path, gpus=list(range(8)), vllm_mode="server", server_url="http://localhost:8002")
    assert p.spec.vllm_server_base_url == "http://localhost:8002"
    assert (_flag(p.server_cmd, "--host"), _flag(p.server_cmd, "--port")) == ("127.0.0.1", "8002")


def test_a_spec_files_old_server_url_is_still_replaced_by_this_launchs_server(tmp_path, capsys):
    """A URL that comes in a --spec file (an earlier launch's launch_spec.json) is not this launch's: the trainers
    use the server this launch starts, on loopback at --port (8000 by default), as before."""
    old = tmp_path / "old_spec.json"
    old.write_text(json.dumps({"prompts_per_step": 112, "vllm_server_base_url": "http://node0:8123"}))
    rc, spec_file = _dry_run(tmp_path, "--spec", str(old))
    assert rc == 0 and json.loads(spec_file.read_text())["vllm_server_base_url"] == "http://127.0.0.1:8000"
    assert "--host 127.0.0.1 --port 8000" in capsys.readouterr().out
    rc, spec_file = _dry_run(tmp_path, "--spec", str(old), "--port", "8124")
    assert rc == 0 and json.loads(spec_file.read_text())["vllm_server_base_url"] == "http://127.0.0.1:8124"
    # the URL given to this launch wins over the spec file's
    rc, spec_file = _dry_run(tmp_path, "--spec", str(old), "--set", "vllm_server_base_url=http://node1:8200")
    assert rc == 0 and json.loads(spec_file.read_text())["vllm_server_base_url"] == "http://node1:8200"


def test_a_server_url_that_contradicts_the_port_or_is_no_address_is_refused(tmp_path, capsys):
    """The server listens on one port: a --port other than the URL's is refused, naming both; so is a URL that is
    no http(s)://host:port (the server could not listen where it points). The CLI exits 2 with the message."""
    rc, _ = _dry_run(tmp_path, "--set", "vllm_server_base_url=http://node0:8123", "--port", "8000")
    err = capsys.readouterr().err
    assert rc == 2 and "--port 8000" in err and "http://node0:8123" in err and "8123" in err
    spec = preset("qwen2.5-7b", prompts_per_step=112)
    for url in ("node0:8000", "http://node0", "ftp://node0:8000", "http://node0:8000/v1", "http://node0:port",
                "http://0.0.0.0:8000"):
        rc, _ = _dry_run(tmp_path, "--set", f"vllm_server_base_url={url}")
        assert rc == 2 and url in capsys.readouterr().err, url
        with pytest.raises(ValueError, match="http://HOST:PORT"):
            L.plan(spec, tmp_path, gpus=list(range(8)), vllm_mode="server", server_url=url)
    with pytest.raises(ValueError, match=r"--port 8000 .*http://node0:8123"):
        L.plan(spec, tmp_path, gpus=list(range(8)), vllm_mode="server", port=8000, server_url="http://node0:8123")
    for port in ("99999", "0"):  # vllm serve failed on it after the launch began
        rc, _ = _dry_run(tmp_path, "--vllm-mode", "server", "--port", port)
        assert rc == 2 and f"--port {port}: a TCP port is 1 to 65535" in capsys.readouterr().err


def test_layouts_are_checked_as_the_ranks_check_them():
    """Launch refused only rows that do not split; the ranks also need whole groups and micro-batches that split
    (8 GPUs x 4 prompts: 1 micro-batch per rank, updates_per_generation 2: every rank failed at start)."""
    spec = preset("qwen2.5-7b", prompts_per_step=4)
    with pytest.raises(ValueError, match=r"updates_per_generation \(2\) must divide the 1 micro-batches"):
        L.plan_layout(spec, 8)
    # server mode takes the largest trainer count the ranks accept (3 prompts: 1 or 3 trainers, not 6)
    lay = L.plan_layout(preset("qwen2.5-7b", prompts_per_step=3, updates_per_generation=1), 8, vllm_mode="server")
    assert lay.num_processes == 3 and "7 trainers do not fit" in lay.notes[0]


def test_accelerate_mixed_precision_follows_bf16():
    """The configs say bf16 and accelerate exports it to the ranks, where bf16=False does not override it."""
    def precision(**kw):
        cmd = L.accelerate_command(RunSpec(**kw), config="single_gpu", num_processes=1, spec_path="s", output_dir="o")
        return cmd[cmd.index("--mixed_precision") + 1]

    assert (precision(), precision(bf16=True), precision(bf16=False)) == ("bf16", "bf16", "no")


def test_plan_colocate_single_gpu(tmp_path):
    p = L.plan(preset("qwen2.5-7b"), tmp_path, gpus=[0])
    assert p.server_cmd is None and p.layout.mode == "colocate"
    assert "single_gpu.yaml" in p.train_cmd[p.train_cmd.index("--config_file") + 1]
    assert p.spec.vllm_mode == "colocate" and p.spec.vllm_server_base_url is None


def test_launch_streams_logs_and_reads_result(tmp_path, monkeypatch):
    """launch() with the accelerate command replaced by a tiny Python script: logs are streamed to the callback
    and launch.log, the spec file is written, and train_result.json is returned."""
    spec = RunSpec()
    script = tmp_path / "fake.py"
    script.write_text(
        "import json, os, sys\n"
        "out = sys.argv[sys.argv.index('--output-dir') + 1]\n"
        "spec = json.load(open(sys.argv[sys.argv.index('--spec') + 1]))\n"
        "print('rank0 step 1', flush=True)\n"
        "print('gpus', os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
        "json.dump({'global_step': 3, 'method': spec['method']}, open(os.path.join(out, 'train_result.json'), 'w'))\n"
    )
    real = L.accelerate_command

    def fake(*a, **kw):
        cmd = real(*a, **kw)
        return [sys.executable, str(script), *cmd[cmd.index("train") + 1:]]

    monkeypatch.setattr(L, "accelerate_command", fake)
    lines: list[str] = []
    res = L.launch(spec, tmp_path / "run", gpus=[0, 1], log=lines.append)
    assert res.ok and res.result == {"global_step": 3, "method": "sage"}
    assert "rank0 step 1" in lines and "gpus 0,1" in lines
    assert "rank0 step 1" in res.log_path.read_text()
    assert json.loads((tmp_path / "run" / "launch_spec.json").read_text())["method"] == "sage"


def test_launch_failure_raises_with_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "accelerate_command",
                        lambda *a, **kw: [sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="code 3(.|\n)*boom"):
        L.launch(RunSpec(), tmp_path, gpus=[0], log=lambda s: None)
    res = L.launch(RunSpec(), tmp_path, gpus=[0], log=lambda s: None, check=False)
    assert res.returncode == 3 and res.result is None and res.tail == ["boom"]


def test_a_stopped_launch_stops_its_training_processes_and_reads_their_last_words(tmp_path, monkeypatch):
    """launch() stopped while the ranks train (here a real SIGINT, as Ctrl-C; `sage launch` raises SIGTERM the same
    way) stops the `accelerate launch` child it started, which would otherwise train on, holding the GPUs, into a run
    already marked KILLED. The child's output is still read while it stops: ranks that print more than a pipe holds
    (tracebacks, warnings) on their way out would otherwise block, and be SIGKILLed a minute later, their last lines
    lost."""
    import os
    import signal

    beat = tmp_path / "beat"
    child = (f"import pathlib, signal, sys, time\nbeat = pathlib.Path({str(beat)!r})\n"
             "def stop(*_):\n    sys.stdout.write('shutting down ' * 20000 + '\\n')\n    print('bye', flush=True)\n"
             "    sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\nbeat.write_text(str(time.time()))\n"
             "print('rank0', 'up', flush=True)\n"
             "while True:\n    beat.write_text(str(time.time())); time.sleep(0.1)\n")
    monkeypatch.setattr(L, "accelerate_command", lambda *a, **kw: [sys.executable, "-c", child])
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line == "rank0 up":
            os.kill(os.getpid(), signal.SIGINT)

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        L.launch(RunSpec(), tmp_path / "run", gpus=[0], log=log)
    assert time.monotonic() - t0 < 30, "the child was not stopped at once"
    assert lines[-1] == "bye" and "bye" in (tmp_path / "run" / "launch.log").read_text()  # read while it stopped
    first = beat.read_text()
    time.sleep(0.5)
    assert beat.read_text() == first, "the training process outlived launch()"


def test_wait_for_server_fails_fast_when_process_dies():
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with code 1"):
        L.wait_for_server("http://127.0.0.1:9", timeout=5, proc=proc, interval=0.1)
    with pytest.raises(TimeoutError):
        L.wait_for_server("http://127.0.0.1:9", timeout=0.3, interval=0.1)


# ------------------------------------------------------------------------------------ benchmarks/gpu_smoke.py
def _gpu_smoke():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_smoke_on_cpu_exits_with_clear_message():
    gs = _gpu_smoke()
    if not gs.missing_requirements():
        pytest.skip("vllm is present: the skip path does not apply")
    script = str(ROOT / "benchmarks" / "gpu_smoke.py")
    r = __import__("subprocess").run([sys.executable, script], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == gs.EXIT_NO_GPU != 0 and "needs vllm" in r.stdout and "make vllm-cpu" in r.stdout
    r = __import__("subprocess").run([sys.executable, script, "--allow-cpu-skip"], capture_output=True, text=True,
                                     cwd=ROOT)
    assert r.returncode == 0 and "Nothing was run" in r.stdout


def test_gpu_smoke_with_hf_generate_runs_without_vllm(tiny_model_dir, tmp_path):
    """--hf-generate: the smoke table from HF generate, no vLLM needed (a GPU without it; here, the CPU)."""
    import json
    import subprocess

    out = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--hf-generate", "--methods",
                        "grpo,sage", "--steps", "2", "--out", str(tmp_path / "runs"), "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads(out.read_text())
    assert "HF generate (no vLLM)" in got["header"] and got["failed"] == []
    grpo, sage = got["rows"]["grpo"], got["rows"]["sage"]
    assert grpo["rollouts"] == 8 * 8 and sage["rollouts"] >= grpo["rollouts"]  # 8 prompts x G=8; SAGE re-rolls
    assert grpo["steps"] == sage["steps"] == 1 and grpo["step_s"] > 0 and grpo["tok_s"] > 0
    spec = json.loads((tmp_path / "runs" / "sage" / "smoke_metrics.json").read_text())["spec"]
    assert spec["use_vllm"] is False and spec["method"] == "sage"


def test_gpu_smoke_refuses_a_set_that_contradicts_hf_generate_or_names_no_field(capsys):
    gs = _gpu_smoke()
    for sets in (["use-vllm=true"], ["use_vllm=true"], ["bogus=1"]):
        with pytest.raises(SystemExit):
            gs.main(["--hf-generate", *[x for s in sets for x in ("--set", s)]])
    err = capsys.readouterr().err
    assert err.count("leave use_vllm out of --set") == 2 and "unknown RunSpec field 'bogus'" in err


def test_gpu_smoke_metrics_and_table():
    gs = _gpu_smoke()
    hist = [{"step_time": 9.0, "sage/gen_seconds": 8.0, "sage/rollouts": 64, "completions/mean_length": 10,
             "sage/activation_mb": 99.0},
            {"step_time": 1.0, "sage/gen_seconds": 0.5, "sage/rollouts": 64, "completions/mean_length": 20,
             "reward": 0.5, "sage/activation_mb": 3.0},
            {"step_time": 3.0, "sage/gen_seconds": 1.5, "sage/rollouts": 64, "completions/mean_length": 20,
             "reward": 0.7, "sage/activation_mb": 5.0},
            {"train_runtime": 13.0}]
    m = gs.step_metrics(hist)  # step 1 (warm-up) left out
    assert m["steps"] == 2 and m["step_s"] == 2.0 and m["gen_s"] == 1.0 and m["rollouts"] == 64
    assert m["tok_s"] == 64 * 20 / 1.0 and abs(m["reward"] - 0.6) < 1e-9  # warm-up left out of the timings
    assert m["act_mb"] == 99.0  # bytes, not time: the largest step's, the first included
    m["peak_gib"] = 1.25
    sage = dict(m, step_s=3.0, tok_s=m["tok_s"] / 2)
    table = gs.format_table({"grpo": m, "sage": sage}, header="gpu_smoke: test")
    lines = table.splitlines()
    assert lines[0] == "gpu_smoke: test" and lines[1].split()[0] == "method"
    grpo_row, sage_row = lines[2].split(), lines[3].split()
    assert grpo_row[0] == "grpo" and grpo_row[7:9] == ["1.00x", "1.00x"]
    assert sage_row[0] == "sage" and sage_row[7:9] == ["1.50x", "0.50x"] and sage_row[10:] == ["99.0", "1.25"]
    assert gs.format_table({"sage": sage}).splitlines()[1].split()[7] == "-"  # no GRPO row: no ratio


def test_visible_gpus_keeps_cuda_visible_devices_entries(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert L.visible_gpus() == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    assert L.visible_gpus() == ["GPU-aaa", "GPU-bbb"]
    p = L.plan(preset("qwen2.5-7b", prompts_per_step=112), tmp_path, vllm_mode="server")
    assert p.server_env["CUDA_VISIBLE_DEVICES"] == "GPU-aaa" and p.train_env["CUDA_VISIBLE_DEVICES"] == "GPU-bbb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert L.visible_gpus() == []


def test_visible_gpus_stop_where_cuda_stops_reading(monkeypatch, tmp_path):
    """CUDA_VISIBLE_DEVICES=-1 (a common way to hide the GPUs) is no GPU named '-1', and CUDA ignores every entry
    after an invalid one: a launch must not plan ranks on GPUs the processes cannot see."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert L.visible_gpus() == []
    with pytest.raises(ValueError, match="no CUDA GPU visible"):
        L.plan(preset("tiny-cpu"), tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2,-1,1")
    assert L.visible_gpus() == [0, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaa,GPU-bbb,nope,3")
    assert L.visible_gpus() == ["MIG-aaa", "GPU-bbb"]


# ----------------------------------------------------------------------------------- $SAGE_TRAIN_VENV
def _fake_bin(folder: Path, *names: str, mode: int = 0o755) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        f = folder / name
        f.write_text("#!/bin/sh\n")
        f.chmod(mode)
    return folder


def test_train_venv_scripts_run_the_ranks_and_the_server(tmp_path, monkeypatch):
    """$SAGE_TRAIN_VENV set: `accelerate` and `vllm` are that venv's, even where this interpreter's venv has its
    own, and both processes get the venv's bin first on PATH (DeepSpeed's JIT runs `ninja` by name)."""
    venv = tmp_path / "venv-gpu"
    _fake_bin(venv / "bin", "accelerate", "vllm")
    _fake_bin(tmp_path / "app" / "bin", "python", "accelerate", "vllm")
    monkeypatch.setattr(L.sys, "executable", str(tmp_path / "app" / "bin" / "python"))
    monkeypatch.setenv(L.TRAIN_VENV_ENV, str(venv))
    spec = preset("qwen2.5-7b", prompts_per_step=112)
    cmd = L.accelerate_command(spec, config="zero3", num_processes=8, spec_path="s", output_dir="o")
    assert cmd[:2] == [str(venv / "bin" / "accelerate"), "launch"]
    assert L.vllm_server_command("m")[:3] == [str(venv / "bin" / "vllm"), "serve", "m"]
    p = L.plan(spec, tmp_path / "run", gpus=list(range(8)), vllm_mode="server",
               env={"PATH": "/usr/bin:/bin", "VIRTUAL_ENV": "/opt/venv", "A": "1"})
    assert p.train_cmd[0] == str(venv / "bin" / "accelerate")
    assert p.server_cmd[0] == str(venv / "bin" / "vllm")
    for env in (p.train_env, p.server_env):
        assert env["PATH"] == f"{venv / 'bin'}:/usr/bin:/bin" and env["VIRTUAL_ENV"] == str(venv)
        assert env["A"] == "1"
    shell = p.shell().splitlines()
    assert f"CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 {venv}/bin/vllm serve " in shell[0]
    assert f"{venv}/bin/accelerate launch" in shell[1]


def test_dry_run_lines_run_in_the_train_venv_as_launch_runs_them(tmp_path, monkeypatch):
    """The lines `sage launch --dry-run` prints, pasted into a shell, start the ranks and the server with the
    environment launch() gives them: $SAGE_TRAIN_VENV's bin first on PATH and VIRTUAL_ENV (they printed bare
    CUDA_VISIBLE_DEVICES=..., so `ninja` and the rest came from whatever PATH the shell had)."""
    venv = tmp_path / "venv gpu"  # a space: the printed line quotes it
    _fake_bin(venv / "bin", "accelerate", "vllm")
    for name in ("accelerate", "vllm"):  # each prints the environment it was started with
        (venv / "bin" / name).write_text('#!/bin/sh\necho "$VIRTUAL_ENV|$PATH|$CUDA_VISIBLE_DEVICES"\n')
    monkeypatch.setenv(L.TRAIN_VENV_ENV, str(venv))
    env = {"PATH": "/usr/bin:/bin", "VIRTUAL_ENV": "/opt/venv"}
    p = L.plan(preset("qwen2.5-7b", prompts_per_step=112), tmp_path / "run", gpus=list(range(8)),
               vllm_mode="server", env=env)
    server_line, train_line = p.shell().splitlines()
    for line, run_env in ((server_line.removesuffix(" &"), p.server_env), (train_line, p.train_env)):
        got = subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True, check=True).stdout
        assert got.strip() == f"{run_env['VIRTUAL_ENV']}|{run_env['PATH']}|{run_env['CUDA_VISIBLE_DEVICES']}"
    assert p.train_env["PATH"] == f"{venv / 'bin'}:/usr/bin:/bin"
    monkeypatch.delenv(L.TRAIN_VENV_ENV)  # unset: the lines are as before, no PATH of their own
    _fake_bin(tmp_path / "app" / "bin", "python", "accelerate", "vllm")
    monkeypatch.setattr(L.sys, "executable", str(tmp_path / "app" / "bin" / "python"))
    p = L.plan(preset("qwen2.5-7b", prompts_per_step=112), tmp_path / "run", gpus=list(range(8)),
               vllm_mode="server", env=env)
    assert all(line.startswith("CUDA_VISIBLE_DEVICES=") for line in p.shell().splitlines())


def test_train_venv_without_the_script_is_an_error_naming_it(tmp_path, monkeypatch):
    """No silent fallback to this interpreter's or PATH's scripts: the error names the missing path."""
    venv = tmp_path / "venv-gpu"
    _fake_bin(venv / "bin", "accelerate")
    _fake_bin(tmp_path / "app" / "bin", "python", "vllm")
    monkeypatch.setattr(L.sys, "executable", str(tmp_path / "app" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "app" / "bin"))
    monkeypatch.setenv(L.TRAIN_VENV_ENV, str(venv))
    missing = str(venv / "bin" / "vllm")
    with pytest.raises(FileNotFoundError, match=missing):
        L.vllm_server_command("m")
    with pytest.raises(FileNotFoundError, match=missing):
        L.plan(preset("qwen2.5-7b", prompts_per_step=112), tmp_path / "run", gpus=list(range(8)), vllm_mode="server")
    assert L.plan(preset("qwen2.5-7b"), tmp_path / "run", gpus=[0]).train_cmd[0] == str(venv / "bin" / "accelerate")
    _fake_bin(venv / "bin", "vllm", mode=0o644)  # there, but not executable
    with pytest.raises(FileNotFoundError, match=missing):
        L.vllm_server_command("m")
    monkeypatch.setenv(L.TRAIN_VENV_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere" / "bin" / "accelerate")):
        L.accelerate_command(RunSpec(), config="single_gpu", num_processes=1, spec_path="s", output_dir="o")


def test_train_venv_error_is_a_usage_error_in_the_cli(tmp_path, monkeypatch, capsys):
    from sage_core import cli

    monkeypatch.setenv(L.TRAIN_VENV_ENV, str(tmp_path / "nowhere"))
    rc = cli.main(["launch", "--preset", "qwen2.5-7b", "--gpus", "1", "--dry-run", "--output-dir", str(tmp_path)])
    assert rc == 2 and str(tmp_path / "nowhere" / "bin" / "accelerate") in capsys.readouterr().err


def test_scripts_without_train_venv_next_to_the_interpreter_then_path(tmp_path, monkeypatch):
    """$SAGE_TRAIN_VENV unset: this interpreter's venv first (a worker's PATH may lack it), then PATH, then the
    bare name; the environments are left as given."""
    app, other = tmp_path / "app" / "bin", tmp_path / "other" / "bin"
    _fake_bin(app, "python", "accelerate")
    _fake_bin(other, "accelerate", "vllm")
    monkeypatch.setattr(L.sys, "executable", str(app / "python"))
    monkeypatch.setenv("PATH", str(other))
    assert L._venv_script("accelerate") == str(app / "accelerate")
    assert L._venv_script("vllm") == str(other / "vllm")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert L._venv_script("vllm") == "vllm"
    p = L.plan(preset("qwen2.5-7b", prompts_per_step=112), tmp_path / "run", gpus=[0, 1], vllm_mode="server",
               env={"PATH": "/bin"})
    assert p.train_env["PATH"] == p.server_env["PATH"] == "/bin" and "VIRTUAL_ENV" not in p.train_env
