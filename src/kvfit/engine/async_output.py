"""A launched step's outputs on their way to the host.

The engine schedules and launches step k + 1 before it reads step k's tokens, so the host's
scheduling and input preparation overlap the device's work. The results are copied into pinned
host memory behind the step's kernels; an event marks when they are there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvfit.engine.sampler import SamplerOutput, logprob_dicts
from kvfit.engine.sequence import Logprobs, ModelOutput


@dataclass
class PromptLogprobsPart:
    """One sequence's prompt logprobs from one step, from prompt token `first_token` on:
    `num_unscored` None entries (token 0), then one dict per row of each chunk's
    `(ids, logprobs, ranks)` host tensors."""

    first_token: int
    num_unscored: int = 0
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def entries(self) -> list[Logprobs | None]:
        entries: list[Logprobs | None] = [None] * self.num_unscored
        for ids, values, ranks in self.chunks:
            entries += logprob_dicts(ids, values, ranks)
        return entries


@dataclass
class AsyncModelOutput:
    """Rows `sampled_rows` of a `num_seqs` batch sampled; `result()` waits for the copies."""

    num_seqs: int
    sampled_rows: list[int]
    prompt_logprobs: list[PromptLogprobsPart | None]
    sampler_output: SamplerOutput | None = None  # host tensors, valid once the event is done
    num_logprobs: list[int | None] = field(default_factory=list)
    event: torch.cuda.Event | None = None

    def record_event(self, device: torch.device) -> None:
        """Mark the end of the step's work on `device` (nothing to wait for on the CPU)."""
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> ModelOutput:
        """Wait for the step's results and return them as a `ModelOutput`."""
        if self.event is not None:
            self.event.synchronize()
        token_ids: list[int | None] = [None] * self.num_seqs
        logprobs: list[Logprobs | None] = [None] * self.num_seqs
        if self.sampler_output is not None:
            ids, lps = self.sampler_output.to_lists(self.num_logprobs)
            for row, i in enumerate(self.sampled_rows):
                token_ids[i], logprobs[i] = ids[row], lps[row]
        parts = self.prompt_logprobs
        return ModelOutput(token_ids, logprobs,
                           [None if part is None else part.entries() for part in parts],
                           [0 if part is None else part.first_token for part in parts])
