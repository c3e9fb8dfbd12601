"""``kvfold serve``: its command line, the vLLM command it runs, finding the vLLM environment, sizing the
KV space, the supervisor's one-line failures and forwarded signals (no vLLM needed: fake servers).

The server itself is tested in ``tests/integrations/vllm`` (in the environment that has vLLM).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfold.cli import serve
from kvfold.cli.main import main
from kvfold.integrations.vllm import settings
from kvfold.runtime import native

GIB = 1 << 30


def test_help_imports_no_vllm():
    code = (
        "import sys\nfrom kvfold.cli.main import main\ntry:\n    main(['serve', '--help'])\n"
        "except SystemExit:\n    pass\nprint('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "--caches" in out and out.strip().endswith("False")


def _args(tmp_path: Path, *extra: str, **fields) -> argparse.Namespace:
    values = dict(
        model="smollm2-135m",
        caches=tmp_path,
        host="127.0.0.1",
        port=8001,
        max_model_len=None,
        kv_space=None,
        log=None,
        quiet=False,
        vllm_args=list(extra),
    )
    values.update(fields)
    return argparse.Namespace(**values)


def test_the_vllm_command_serves_the_folder_with_the_plugin(tmp_path):
    command = serve.vllm_command(_args(tmp_path, "--", "--max-num-seqs", "4"), "/models/smol", kv_bytes=3 * GIB)
    assert command[:5] == [sys.executable, "-m", serve.VLLM_SERVER, "--model", "/models/smol"]
    value = {command[i]: command[i + 1] for i in range(3, len(command) - 1) if command[i].startswith("--")}
    assert value["--middleware"] == "kvfold.integrations.vllm.server.KvfoldMiddleware"
    assert json.loads(value["--hf-overrides"]) == {"architectures": ["KvfoldLlamaForCausalLM"]}
    transfer = json.loads(value["--kv-transfer-config"])
    assert transfer["kv_connector_module_path"] == "kvfold.integrations.vllm.connector"
    assert transfer["kv_connector_extra_config"]["kvfold_caches"] == str(tmp_path.resolve())
    assert transfer["kv_load_failure_policy"] == "fail"
    assert value["--dtype"] == "float32" and "--enable-prefix-caching" in command
    assert value["--kv-cache-memory-bytes"] == str(3 * GIB)
    assert command[-2:] == ["--max-num-seqs", "4"]


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [
        ("llama", "KvfoldLlamaForCausalLM"),
        ("mistral", "KvfoldMistralForCausalLM"),
        ("mixtral", "KvfoldMixtralForCausalLM"),
        ("qwen2", "KvfoldQwen2ForCausalLM"),
        ("qwen2_moe", "KvfoldQwen2MoeForCausalLM"),
        ("qwen3", "KvfoldQwen3ForCausalLM"),
        ("qwen3_moe", "KvfoldQwen3MoeForCausalLM"),
        ("granite", "KvfoldGraniteForCausalLM"),
    ],
)
def test_the_vllm_command_names_the_model_familys_class(tmp_path, model_type, architecture):
    command = serve.vllm_command(_args(tmp_path), "/models/m", model_type=model_type)
    overrides = command[command.index("--hf-overrides") + 1]
    assert json.loads(overrides) == {"architectures": [architecture]}


# ---------------------------------------------------------------------------- one command
def _no_vllm(monkeypatch) -> None:
    real = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))


def test_without_vllm_it_runs_itself_again_in_the_vllm_environment(capsys, monkeypatch, tmp_path):
    _no_vllm(monkeypatch)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(Path(sys.executable).resolve())  # as in a virtual environment: this same interpreter
    monkeypatch.setenv(serve.ENV_VLLM_PYTHON, str(python))
    monkeypatch.delenv(serve.ENV_RERUN, raising=False)
    ran = {}

    def execve(path, argv, env):
        ran.update(path=path, argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(serve.os, "execve", execve)
    with pytest.raises(SystemExit):
        main(["serve", "--caches", str(tmp_path), "--port", "8123", "--kv-space", "2", "--", "--max-num-seqs", "4"])
    assert ran["path"] == str(python)
    assert ran["argv"] == [
        *(str(python), "-m", "kvfold.cli", "serve", "--model", "smollm2-135m", "--caches", str(tmp_path.resolve())),
        *("--host", "127.0.0.1", "--port", "8123", "--kv-space", "2", "--", "--max-num-seqs", "4"),
    ]
    assert ran["env"][serve.ENV_RERUN] == "1"
    assert "running in" in capsys.readouterr().err


def test_the_vllm_environment_make_install_vllm_made_is_found_beside_the_repository(monkeypatch):
    monkeypatch.delenv(serve.ENV_VLLM_PYTHON, raising=False)
    import kvfold

    root = Path(kvfold.__file__).resolve().parent.parent.parent
    assert serve.vllm_python_candidates()[0] == root / ".venv-vllm" / "bin" / "python"


@pytest.mark.parametrize("case", ["none-found", "found-one-without-vllm"])
def test_without_any_vllm_environment_it_names_the_command_to_run(capsys, monkeypatch, tmp_path, case):
    _no_vllm(monkeypatch)
    if case == "none-found":
        monkeypatch.setattr(serve, "find_vllm_python", lambda: None)
        monkeypatch.delenv(serve.ENV_RERUN, raising=False)
    else:  # this is already the re-run: it does not run itself a third time
        monkeypatch.setenv(serve.ENV_RERUN, "1")
    monkeypatch.setattr(serve.os, "execve", lambda *a: pytest.fail("ran itself again"))
    assert main(["serve", "--caches", str(tmp_path), "--port", "8124"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make install-vllm" in err
    assert f".venv-vllm/bin/kvfold serve --model smollm2-135m --caches {tmp_path.resolve()}" in err
    assert "--port 8124" in err


@pytest.mark.parametrize("case", ["no-folder", "not-served", "narrow-heads", "longrope", "query-scaling"])
def test_what_it_cannot_serve_is_one_line(capsys, monkeypatch, tmp_path, case):
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(serve.os, "execve", lambda *a: pytest.fail("started the server"))
    if case == "no-folder":
        argv = ["serve", "--caches", str(tmp_path / "missing")]
        expected = "no such folder"
    elif case == "narrow-heads":
        model = tmp_path / "qwen"
        model.mkdir()
        shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
        (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **shape}))
        argv = ["serve", "--model", str(model), "--caches", str(tmp_path)]
        expected = "takes heads of 32, 64, 80"
    elif case == "longrope":  # Phi-3.5-mini's RoPE: files of it could not be turned to served positions
        model = tmp_path / "phi"
        model.mkdir()
        shape = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
        rope = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32, "rope_theta": 1e4}
        config = {"model_type": "phi3", **shape, "original_max_position_embeddings": 64, "rope_scaling": rope}
        (model / "config.json").write_text(json.dumps(config))
        argv = ["serve", "--model", str(model), "--caches", str(tmp_path)]
        expected = "RoPE type 'longrope' is not supported"
    elif case == "query-scaling":  # Mistral's queries scaled by position: vLLM would, transformers does not
        model = tmp_path / "mistral"
        model.mkdir()
        shape = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
        scaling = {"original_max_position_embeddings": 64, "beta": 0.1}
        (model / "config.json").write_text(json.dumps({"model_type": "mistral", **shape, "llama_4_scaling": scaling}))
        argv = ["serve", "--model", str(model), "--caches", str(tmp_path)]
        expected = "query scaling by position (llama_4_scaling) is not supported"
    else:
        model = tmp_path / "gemma"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
        argv = ["serve", "--model", str(model), "--caches", str(tmp_path)]
        expected = "serves llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, granite, phi3 models"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


# ---------------------------------------------------------------------------- the KV space
SMOLLM2 = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}


@pytest.fixture
def llama(tmp_path) -> Path:
    """A model folder with SmolLM2's config and no weights (enough to size the KV space)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2))
    return folder


def _serve_until_exec(monkeypatch, argv: list[str]) -> tuple[int | None, dict]:
    """Run ``kvfold serve`` up to the supervisor it becomes: (status, the supervisor's spec or {})."""
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    spec: dict = {}

    def execve(path, args, env):
        spec.update(json.loads(args[-1]))
        raise SystemExit(0)

    monkeypatch.setattr(serve.os, "execve", execve)
    try:
        return main(argv), spec
    except SystemExit:
        return None, spec


def test_the_kv_space_is_sized_from_the_free_memory(monkeypatch, llama, tmp_path, capsys):
    monkeypatch.setattr(settings, "available_memory", lambda: 10 * GIB)
    status, spec = _serve_until_exec(monkeypatch, ["serve", "--model", str(llama), "--caches", str(tmp_path)])
    assert status is None
    command = spec["command"]
    size = int(command[command.index("--kv-cache-memory-bytes") + 1])
    assert size == int(settings.KV_FRACTION * (10 * GIB - settings.SERVER_BYTES))  # no weights here
    assert "--kv-space" not in command and "KV space 1.75 GiB" in spec["start"]
    assert spec["url"] == "http://127.0.0.1:8000" and Path(spec["log"]).name.startswith("kvfold-serve-")


def test_too_little_memory_for_one_full_context_is_one_line(monkeypatch, llama, tmp_path, capsys):
    monkeypatch.setattr(settings, "available_memory", lambda: 3 * GIB)
    status, _ = _serve_until_exec(monkeypatch, ["serve", "--model", str(llama), "--caches", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "3.0 GiB of memory is free" in err and "--max-model-len N" in err and "--kv-space N" in err


def test_a_kv_space_beyond_the_free_memory_is_one_line(monkeypatch, llama, tmp_path, capsys):
    monkeypatch.setattr(settings, "available_memory", lambda: 20 * GIB)
    argv = ["serve", "--model", str(llama), "--caches", str(tmp_path), "--kv-space", "10000"]
    status, spec = _serve_until_exec(monkeypatch, argv)
    err = capsys.readouterr().err
    assert status == 2 and not spec and err.count("\n") == 1
    assert "--kv-space 10000: 20.0 GiB of memory is free; pass a smaller --kv-space" in err


def test_kv_space_passes_on_what_was_asked(monkeypatch, llama, tmp_path):
    monkeypatch.setattr(settings, "available_memory", lambda: 20 * GIB)
    argv = ["serve", "--model", str(llama), "--caches", str(tmp_path), "--kv-space", "0.5"]
    _, spec = _serve_until_exec(monkeypatch, argv)
    command = spec["command"]
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(GIB // 2)


# ---------------------------------------------------------------------------- the pool kernel
def test_the_pool_kernel_is_built_before_vllm_starts(monkeypatch, llama, tmp_path):
    """Built in the engine's first step on a file, its first compile (25 s on 2 free cores, minutes on busy
    ones) would hold every request of that step; built here, the engine loads it from the cache."""
    monkeypatch.setattr(settings, "available_memory", lambda: 20 * GIB)
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    events: list[str] = []
    monkeypatch.setattr(native, "attend_pool_kernel", lambda: events.append("kernel") or object())

    def execve(path, args, env):
        events.append("vllm")
        raise SystemExit(0)

    monkeypatch.setattr(serve.os, "execve", execve)
    with pytest.raises(SystemExit):
        main(["serve", "--model", str(llama), "--caches", str(tmp_path)])
    assert events == ["kernel", "vllm"]


def test_without_a_pool_kernel_serve_says_why_in_one_line_and_starts(monkeypatch, llama, tmp_path, capsys):
    monkeypatch.setattr(settings, "available_memory", lambda: 20 * GIB)
    monkeypatch.setattr(native, "attend_pool_kernel", lambda: None)
    monkeypatch.setattr(native, "pool_status", lambda: "torch (no C compiler found (cc, gcc or clang; or set CC))")
    status, spec = _serve_until_exec(monkeypatch, ["serve", "--model", str(llama), "--caches", str(tmp_path)])
    err = capsys.readouterr().err
    assert status is None and spec  # vLLM starts all the same
    line = "kvfold serve: no pool kernel (torch (no C compiler found (cc, gcc or clang; or set CC))): requests on "
    assert err.count("\n") == 1 and err.startswith(line) and "per-chunk PyTorch path" in err


# ---------------------------------------------------------------------------- the supervisor
MEMORY_ERROR = (
    "(EngineCore pid=7) ERROR 11-28 [core.py:1] ValueError: Available memory on node 0 (13.50/16.60 GiB) on "
    "startup is less than desired CPU memory utilization (0.92, 15.27 GiB). On the CPU backend, the "
    "`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its name)."
)
KV_ERROR = (
    "ValueError: Available memory on node 0 (21.3/23.5 GiB) on kv cache allocation is less than requested "
    "memory for kv (10000.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory"
)
SEQ_ERROR = (
    "ValueError: To serve at least one request with the model's max seq len (8192), (0.44 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.1 GiB). Based on the available memory, ..."
)


@pytest.mark.parametrize(
    "log, expected",
    [
        (MEMORY_ERROR, "not enough free memory for the KV space (15.27 GiB asked, 13.50 of 16.60 GiB free)"),
        (KV_ERROR, "not enough free memory for the KV space (10000.0 GiB asked, 21.3 of 23.5 GiB free)"),
        (SEQ_ERROR, "the KV space (0.1 GiB) holds less than one full context of 8192 tokens (0.44 GiB)"),
        ("OSError: [Errno 98] Address already in use", "the port is in use by another program: pass another --port"),
        (
            "Traceback (most recent call last):\n  ...\nKeyError: 'x'\nRuntimeError: Engine core initialization "
            "failed. See root cause above. Failed core proc(s): {}",
            "vLLM did not start: KeyError: 'x'",
        ),
        ("INFO starting\n", "vLLM exited with status 1 before it was ready"),
    ],
)
def test_a_failed_start_is_explained_from_the_log(log, expected):
    assert serve.start_failure(log, 1).startswith(expected)


FAKE_SERVER = """
import http.server, signal, sys, threading
port, mode = int(sys.argv[1]), sys.argv[2]
print("INFO starting the fake server", flush=True)
if mode == "fail":
    print("Traceback (most recent call last):", flush=True)
    print({error!r}, flush=True)
    sys.exit(1)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); print("GET", self.path, flush=True)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
def stop(signum, frame):
    print("stopping on", signum, flush=True)
    threading.Thread(target=server.shutdown).start()
signal.signal(signal.SIGTERM, stop)
server.serve_forever()
sys.exit(3)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _supervisor(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    """``python -m kvfold.cli.serve --supervise`` over the fake server in ``mode``."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER.format(error=MEMORY_ERROR))
    port, log = _free_port(), tmp_path / "server.log"
    spec = {
        "command": [sys.executable, str(script), str(port), mode],
        "log": str(log),
        "url": f"http://127.0.0.1:{port}",
        "start": "kvfold serve: starting",
        "ready": "kvfold serve: ready",
    }
    command = [sys.executable, "-m", "kvfold.cli.serve", "--supervise", json.dumps(spec)]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True), log


def test_a_server_that_fails_to_start_is_one_line_naming_its_log_and_status_2(tmp_path):
    process, log = _supervisor(tmp_path, "fail")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    lines = err.splitlines()
    assert lines[0] == "kvfold serve: starting" and len(lines) == 2
    assert lines[1].startswith("kvfold serve: error: not enough free memory for the KV space (15.27 GiB asked")
    assert lines[1].endswith(f"(full log: {log})")
    assert "Traceback" in log.read_text() and "Traceback" not in err


def test_once_ready_signals_are_passed_on_and_the_status_is_the_servers(tmp_path):
    process, log = _supervisor(tmp_path, "serve")
    deadline = time.monotonic() + 60
    while "GET /health" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 3  # the fake server's own status, after the forwarded SIGTERM
    assert err.splitlines()[:2] == ["kvfold serve: starting", "kvfold serve: ready"]
    assert f"stopping on {int(signal.SIGTERM)}" in err  # its output goes to stderr once ready
    assert f"stopping on {int(signal.SIGTERM)}" in log.read_text()


def test_a_killed_supervisor_takes_its_server_with_it(tmp_path):
    process, log = _supervisor(tmp_path, "serve")
    deadline = time.monotonic() + 60
    while "GET /health" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    children = [int(p) for p in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
    assert children
    process.kill()
    process.wait()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in children):
        assert time.monotonic() < deadline, "the server outlived its supervisor"
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "Z"
    return stat[stat.rindex(")") + 2]


def test_the_spec_runs_only_from_kvfold_serve(capsys):
    assert serve._main([]) == 2
    assert "kvfold serve runs it" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--gpu-memory-utilization", "--kv-cache-memory-bytes=1000000000"])
def test_vllms_own_memory_flags_are_left_to_it(monkeypatch, llama, tmp_path, flag):
    monkeypatch.setattr(settings, "available_memory", lambda: 20 * GIB)
    argv = ["serve", "--model", str(llama), "--caches", str(tmp_path), "--", flag]
    if "=" not in flag:
        argv.append("0.5")
    _, spec = _serve_until_exec(monkeypatch, argv)
    assert "--kv-cache-memory-bytes" not in spec["command"]  # kvfold's own size is not added
    assert "set by vLLM's " + flag.split("=")[0] in spec["start"]


def test_a_hub_model_is_served_from_its_folder_in_the_hugging_face_cache(monkeypatch, tmp_path, capsys):
    """A hub id: vLLM and the file checks read the model's folder in the cache; requests name the hub id."""
    from kvfold.integrations.vllm.server import ENV_MODEL
    from tests.runtime.test_models import fake_hub_model

    snapshot = fake_hub_model(tmp_path / "hub", monkeypatch)
    monkeypatch.setattr(settings, "available_memory", lambda: 20 * GIB)
    monkeypatch.setattr(native, "attend_pool_kernel", lambda: object())
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    seen: dict = {}

    def execve(path, args, env):
        seen.update(spec=json.loads(args[-1]), env=env)
        raise SystemExit(0)

    monkeypatch.setattr(serve.os, "execve", execve)
    with pytest.raises(SystemExit):
        main(["serve", "--model", "org/tiny", "--caches", str(tmp_path)])
    command = seen["spec"]["command"]
    assert command[command.index("--model") + 1] == str(snapshot)
    assert command[command.index("--served-model-name") + 1] == "org/tiny"
    assert json.loads(command[command.index("--hf-overrides") + 1]) == {"architectures": ["KvfoldQwen3ForCausalLM"]}
    assert seen["env"][ENV_MODEL] == str(snapshot)
    assert "org/tiny: from the Hugging Face cache" in capsys.readouterr().err
