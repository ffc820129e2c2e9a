"""`swarm-api`: an OpenAI-compatible HTTP API and a chat page on top of the swarm client."""
