"""llm-swarm's shared layer: what clients, servers and the scheduler all use."""

import os

# gRPC (the scheduler's API) since 1.74 turns its C-core fork handlers on by default. Our processes
# that hold gRPC channels also fork (every hivemind DHT peer is a forked process, and it forks again
# to start its p2p daemon); with those handlers on, such a child sometimes crashes (SIGSEGV/SIGABRT:
# seen as "a DHT peer was not ready" in CI). No forked child of ours uses gRPC, so the handlers have
# nothing to protect. This must be set before gRPC is first imported: every module of ours that
# imports grpc imports this package first (scheduler/__init__.py makes sure for the generated code).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
