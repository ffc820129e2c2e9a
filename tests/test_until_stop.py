"""`swarm.until_stop`: a DHT call in a loop that must also stop when asked (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from llm_swarm.swarm.until_stop import Stopped, until_stop

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def test_the_answer_the_timeout_and_a_stop_that_comes_first():
    async def scenario():
        stop = asyncio.Event()

        async def answer():
            await asyncio.sleep(0.01)
            return 42

        assert await until_stop(answer(), stop, timeout=5.0) == 42
        never = asyncio.get_running_loop().create_future()  # a DHT that stopped answering
        with pytest.raises(TimeoutError):
            await until_stop(never, stop, timeout=0.05)
        hanging = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        with pytest.raises(Stopped):
            await until_stop(hanging, stop, timeout=60.0)
        await asyncio.sleep(0)
        assert hanging.cancelled()  # the call is given up, not left running

    asyncio.run(scenario())
