"""``kvfold serve``: its command line, the vLLM command it runs, and one-line errors (no vLLM needed).

The server itself is tested in ``tests/integrations/vllm`` (in the environment that has vLLM).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfold.cli import serve
from kvfold.cli.main import main


def test_help_imports_no_vllm():
    code = (
        "import sys\nfrom kvfold.cli.main import main\ntry:\n    main(['serve', '--help'])\n"
        "except SystemExit:\n    pass\nprint('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "--caches" in out and out.strip().endswith("False")


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    return argparse.Namespace(
        model="smollm2-135m",
        caches=tmp_path,
        host="127.0.0.1",
        port=8001,
        max_model_len=None,
        kv_space=None,
        vllm_args=list(extra),
    )


def test_the_vllm_command_serves_the_folder_with_the_plugin(tmp_path):
    command = serve.vllm_command(_args(tmp_path, "--", "--max-num-seqs", "4"), "/models/smol")
    assert command[:5] == [sys.executable, "-m", serve.VLLM_SERVER, "--model", "/models/smol"]
    value = {command[i]: command[i + 1] for i in range(3, len(command) - 1) if command[i].startswith("--")}
    assert value["--middleware"] == "kvfold.integrations.vllm.server.KvfoldMiddleware"
    assert json.loads(value["--hf-overrides"]) == {"architectures": ["KvfoldLlamaForCausalLM"]}
    transfer = json.loads(value["--kv-transfer-config"])
    assert transfer["kv_connector_module_path"] == "kvfold.integrations.vllm.connector"
    assert transfer["kv_connector_extra_config"]["kvfold_caches"] == str(tmp_path.resolve())
    assert transfer["kv_load_failure_policy"] == "fail"
    assert value["--dtype"] == "float32" and "--enable-prefix-caching" in command
    assert command[-2:] == ["--max-num-seqs", "4"]


def test_without_vllm_it_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    real = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    assert main(["serve", "--caches", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kvfold[vllm]'" in err and err.count("\n") == 1


@pytest.mark.parametrize("case", ["no-folder", "not-llama"])
def test_what_it_cannot_serve_is_one_line(capsys, monkeypatch, tmp_path, case):
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: object())
    if case == "no-folder":
        argv = ["serve", "--caches", str(tmp_path / "missing")]
        expected = "no such folder"
    else:
        model = tmp_path / "qwen"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
        argv = ["serve", "--model", str(model), "--caches", str(tmp_path)]
        expected = "serves llama models"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
