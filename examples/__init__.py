"""Example agents (ordinary OpenAI-SDK programs) and their task files; installed as `agentstream.examples`, which
the demos run (`python -m agentstream.examples.single_turn`)."""
