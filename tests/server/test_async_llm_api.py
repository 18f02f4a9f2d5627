"""`AsyncLLM` called as vLLM's: code written for vLLM's `AsyncLLM` (a custom server, an RL
trainer) runs against kvfit's, under vLLM's names and calling conventions."""

from __future__ import annotations

import asyncio

from kvfit import SamplingParams
from kvfit.engine.outputs import RequestOutput
from kvfit.server.async_llm import AsyncLLM


def test_generate_takes_vllms_keywords(engine: AsyncLLM) -> None:
    # vLLM's examples call `engine.generate(prompt=..., sampling_params=..., request_id=...)`:
    # `sampling_params=` was a TypeError (the argument was named `params`).
    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def run() -> tuple[RequestOutput, RequestOutput]:
        by_keyword = [out async for out in engine.generate(
            prompt="The sky is", sampling_params=params, request_id="keywords")][-1]
        by_position = [out async for out in engine.generate("The sky is", params)][-1]
        return by_keyword, by_position

    by_keyword, by_position = asyncio.run(run())
    assert by_keyword.request_id == "keywords" and by_keyword.finished
    assert by_keyword.outputs[0].token_ids == by_position.outputs[0].token_ids
    assert len(by_keyword.outputs[0].token_ids) == 6
