"""The built-in models' names, importable without torch (the CLI reads them to register its
commands)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).parent / "configs"
# kvfit-sotu ships trained weights (tools/tiny_model); the others are shapes, filled with
# seeded dummy weights.
BUILTIN_MODELS = ("kvfit-tiny", "kvfit-sotu", "qwen3-0.6b-shape", "qwen3-8b-shape")
DEFAULT_MODEL = "kvfit-sotu"
"""The model of the commands that show a model's text (`generate`, `chat`, `serve`) when none
is named: the built-in with trained weights, whose greedy output is English where the shapes'
random weights print noise. (`EngineArgs.model`, the library's default, stays kvfit-tiny.)"""
