"""The `interpret` tests (Triton kernels through Triton's interpreter) in a child pytest with
TRITON_INTERPRET=1, so that a plain `python3 -m pytest` (CI's) checks the kernels on the CPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so one process either interprets
every kernel or compiles them all (tests/tools/test_triton_compile.py). This process compiles;
the child interprets the `interpret` tests this session selected (see `_skip_interpret_tests`
in tests/conftest.py). To run them directly, with their own output:
    TRITON_INTERPRET=1 python3 -m pytest -q -m interpret tests/ops
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the `interpret` tests run in this process"
)
pytest.importorskip("triton")


def _child_args(config: pytest.Config, files: list[str]) -> list[str]:
    """`-m interpret` over `files` (all tests/ when none were selected here, e.g. when this
    file runs alone), narrowed by this session's own `-m` and `-k`."""
    markexpr = config.option.markexpr
    marks = f"interpret and ({markexpr})" if markexpr else "interpret"
    args = ["-m", marks, *(files or ["tests"])]
    if files and config.option.keyword:
        args += ["-k", config.option.keyword]
    return args


def test_kernels_under_the_triton_interpreter(pytestconfig: pytest.Config,
                                              interpreted_files: list[str]) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
           *_child_args(pytestconfig, interpreted_files)]  # fmt: skip
    child = subprocess.run(cmd, cwd=pytestconfig.rootpath, env=env, capture_output=True,
                           text=True)  # fmt: skip
    if child.returncode != 0:
        # The failing tests' names first (the child's short summary), then its whole report.
        output = child.stdout + child.stderr
        failed = "\n".join(re.findall(r"^(?:FAILED|ERROR) .*$", output, re.MULTILINE))
        pytest.fail(f"TRITON_INTERPRET=1 {shlex.join(['python3', *cmd[1:]])} exited "
                    f"{child.returncode}:\n{failed or '(no test failed: see below)'}\n\n{output}",
                    pytrace=False)
