"""Processes of a local swarm for tests, benchmarks and examples: a DHT, servers, schedulers and their
logs on this machine (`local_swarm`), started fast from a preloaded interpreter (`preloaded_launcher`,
`zygote`), and stand-in records of servers that never answer (`standin_records`)."""
