"""A server whose outputs are wrong, for tests only: `python -m tests.lying_server MODE SERVER_ARGS...`.

MODE `noise` adds noise of half the output's norm to every step's output (plausible, finite, wrong);
`nan` returns NaN. In chain sessions: `push-noise` answers its client honestly but pushes noisy outputs
to the next server; `digest` runs what it is pushed honestly but answers with a false digest of its
input. `frame` answers steps sent as step frames with a frame cut short (malformed). Everything else
is the real `swarm-server`: it announces, measures and serves as an honest one would, which is what
makes it dangerous.
"""

from __future__ import annotations

import sys

import torch

from llm_swarm.server import handler
from llm_swarm.swarm.step_frame import StepFrame


def main() -> None:
    mode = sys.argv.pop(1)
    if mode not in ("noise", "nan", "push-noise", "digest", "frame"):
        raise SystemExit(f"unknown mode {mode!r}: noise, nan, push-noise, digest or frame")
    if mode == "frame":
        honest_frame = handler.encode_frame

        def cut_frame(message, tensors):
            whole = b"".join(bytes(part) for part in honest_frame(message, tensors).parts)
            return StepFrame.received(whole[:-4])

        handler.encode_frame = cut_frame
        return _serve()
    if mode == "push-noise":
        honest_push = handler.BlockServicer._push_on

        def noisy_push(self, session, step_id, position, hypo_ids, output, *args):
            return honest_push(self, session, step_id, position, hypo_ids, _noisy(output), *args)

        handler.BlockServicer._push_on = noisy_push
        return _serve()
    if mode == "digest":
        handler.step_digest = lambda *_: "0" * 32
        return _serve()
    honest_compute = handler.BlockServicer._compute

    async def lying_compute(self, session, hidden, *args, **kwargs):
        output = await honest_compute(self, session, hidden, *args, **kwargs)
        if mode == "nan":
            return torch.full_like(output, float("nan"))
        return _noisy(output)

    handler.BlockServicer._compute = lying_compute
    _serve()


def _noisy(output: torch.Tensor) -> torch.Tensor:
    noise = torch.randn_like(output)
    return output + noise * (0.5 * output.norm() / noise.norm().clamp_min(1e-12))


def _serve() -> None:
    from llm_swarm.server.cli import main as server_main

    server_main()


if __name__ == "__main__":
    main()
