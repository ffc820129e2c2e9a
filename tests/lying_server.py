"""A server whose outputs are wrong, for tests only: `python -m tests.lying_server MODE SERVER_ARGS...`.

MODE `noise` adds noise of half the output's norm to every step's output (plausible, finite, wrong);
`nan` returns NaN. Everything else is the real `swarm-server`: it announces, measures and serves as
an honest one would, which is what makes it dangerous.
"""

from __future__ import annotations

import sys

import torch

from llm_swarm.server import handler


def main() -> None:
    mode = sys.argv.pop(1)
    if mode not in ("noise", "nan"):
        raise SystemExit(f"unknown mode {mode!r}: noise or nan")
    honest_compute = handler.BlockServicer._compute

    async def lying_compute(self, session, hidden, *args, **kwargs):
        output = await honest_compute(self, session, hidden, *args, **kwargs)
        if mode == "nan":
            return torch.full_like(output, float("nan"))
        noise = torch.randn_like(output)
        return output + noise * (0.5 * output.norm() / noise.norm().clamp_min(1e-12))

    handler.BlockServicer._compute = lying_compute
    from llm_swarm.server.cli import main as server_main

    server_main()


if __name__ == "__main__":
    main()
