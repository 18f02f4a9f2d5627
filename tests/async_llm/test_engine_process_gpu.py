"""`AsyncLLM` with its engine in a process of its own, on the GPU: only the engine process holds
the device. Needs no server packages (AsyncLLM imports none), so it runs where FastAPI is not
installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams

SRC = Path(__file__).resolve().parents[2] / "src"


_NO_CUDA_IN_THE_SERVER = """
import asyncio, json, sys, torch
from kvfit import SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.server.async_llm import AsyncLLM

engine = AsyncLLM(EngineArgs(**json.loads(sys.argv[1])))

async def text():
    output = None
    async for output in engine.generate("The number 3 is followed by",
                                        SamplingParams(temperature=0.0, max_tokens=8)):
        pass
    return output.outputs[0].text

try:
    print(json.dumps({"text": asyncio.run(text()), "cuda": torch.cuda.is_initialized()}))
finally:
    engine.shutdown()
"""


@pytest.mark.gpu
def test_the_server_process_never_creates_a_cuda_context(
        tiny_model: Callable[[str], Path]) -> None:
    """Only the engine process holds the device: a CUDA context in the server's process would
    take memory the engine measured as free."""
    kwargs = {"model": str(tiny_model("qwen3")), "device": "cuda", "max_model_len": 128,
              "num_gpu_blocks_override": 256, "max_num_seqs": 8}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", _NO_CUDA_IN_THE_SERVER, json.dumps(kwargs)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["cuda"] is False
    llm = LLM(**kwargs)
    try:
        (ref,) = llm.generate("The number 3 is followed by",
                              SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    finally:
        llm.shutdown()
    assert got["text"] == ref.outputs[0].text
