"""The scheduler's gRPC API (generated from scheduler.proto by scripts/gen_proto.sh): the wire contract
that clients, servers and the scheduler service share."""
