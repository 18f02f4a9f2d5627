"""Every command and code block of README.md runs, as written, on this machine.

`kvfit ...` commands run the real entry point (`python -m kvfit`) in a subprocess; the Python
blocks run in a subprocess of their own. Placeholders for a downloaded model
(`/path/to/...`) become a tiny random-weight Hugging Face folder with a tokenizer, the server
port a free one; nothing else is changed. A README command this file does not know how to run
fails the test, so a new one cannot go untested.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvfit

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SETUP = ("python3 -m pip install torch==2.13.0 -e . && kvfit generate",
         "python3 -m pip install torch==2.13.0 -e '.[dev,server]' && python3 -m ruff check src "
         "tests bench && python3 -m pytest -q")
GPU_ONLY = "PYTHONPATH=src python3 -m pytest -m gpu"
PLACEHOLDER = re.compile(r"/path/to/[\w.-]+")


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands(block: str) -> list[str]:
    """A bash block's commands: continuation lines joined, trailing comments dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line]


BASH = [c for block in code_blocks("bash") for c in commands(block)]
SERVE = [c for c in BASH if c.startswith(("kvfit serve", "curl "))]
KVFIT = [c for c in BASH if c.startswith("kvfit ") and c not in SERVE]
PYTHON = code_blocks("python")


def env() -> dict[str, str]:
    # One torch thread: the machine is shared. Offline: the README promises no downloads.
    return {**os.environ, "PYTHONPATH": str(Path(kvfit.__file__).parents[1]),
            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run(argv: list[str], timeout: float = 300, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env(), **kwargs)


@pytest.fixture(scope="module")
def model_folder(tiny_model: Callable[[str], Path]) -> str:
    """What `/path/to/...` stands for: a local Hugging Face folder with a tokenizer."""
    return str(tiny_model("qwen3"))


def test_every_readme_command_is_run_here() -> None:
    assert [" ".join(commands(b)) for b in code_blocks("bash")[:2]] == list(SETUP)  # set-up
    known = {*SETUP, GPU_ONLY, *SERVE, *KVFIT}
    assert [c for c in BASH if c not in known] == []
    # The set-up's own `kvfit generate` is the first command below.
    assert KVFIT[0] == "kvfit --version" and "kvfit generate" in SETUP[0]
    assert len(PYTHON) == 2 and len(SERVE) == 2


def test_readme_test_command_is_what_ci_runs() -> None:
    # .ci/run's commands in order (pip's -q aside): the README's set-up for the tests.
    ci = [line.replace("pip install -q ", "pip install ")
          for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python3 ")]
    assert " && ".join(ci) == SETUP[1]


# A real shape (random weights) on the CPU: about a minute; runs by default (`-m "not slow"`
# leaves it out of a quick local run).
@pytest.mark.parametrize("command", [
    pytest.param(c, marks=pytest.mark.slow) if "-shape" in c else c
    for c in ["kvfit generate", *KVFIT]
])
def test_kvfit_command(command: str, model_folder: str) -> None:
    argv = shlex.split(PLACEHOLDER.sub(model_folder, command))
    result = run([sys.executable, "-m", "kvfit", *argv[1:]])
    assert result.returncode == 0, result.stderr[-3000:]
    if argv[1] == "generate":
        assert "completion: " in result.stdout and "KV cache blocks" in result.stderr


def test_python_api_block(model_folder: str) -> None:
    # `trainer_state_dict` stands for a trainer's weights: the model's own, read back.
    prelude = ("import safetensors.torch\ntrainer_state_dict = safetensors.torch.load_file("
               f"{model_folder + '/model.safetensors'!r})\n")
    code = prelude + PLACEHOLDER.sub(model_folder, PYTHON[0])
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KV cache blocks" in result.stdout and "kvfit:num_requests_running" in result.stdout
    # Every labelled series is printed: the one finished request shows under its reason.
    success = [float(line.split()[-1]) for line in result.stdout.splitlines()
               if line.startswith("kvfit:request_success ")]
    assert len(success) == 3 and sum(success) == 1.0, result.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server(model_folder: str) -> Iterator[int]:
    """The README's `kvfit serve` command, on a free port; yields the port."""
    for module in ("fastapi", "uvicorn", "pydantic", "prometheus_client", "openai"):
        pytest.importorskip(module)  # the server and dev extras (README's test set-up)
    port = _free_port()
    command = PLACEHOLDER.sub(model_folder, SERVE[0]).replace("--port 8000", f"--port {port}")
    proc = subprocess.Popen([sys.executable, "-m", "kvfit", *shlex.split(command)[1:]],
                            cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "kvfit serve did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-3000:]


def test_server_commands_and_client_block(server: int) -> None:
    curl = shlex.split(SERVE[1].replace("localhost:8000", f"localhost:{server}"))
    result = run(curl, timeout=120)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["model"] == "qwen3" and reply["choices"][0]["message"]["content"]
    code = PYTHON[1].replace("localhost:8000", f"localhost:{server}")
    result = run([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip()
