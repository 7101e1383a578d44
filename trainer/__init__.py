"""The trainer: learns from the `trajectories` topic with verl's algorithms and announces each new
weight version on the `weights` topic. Run it with `python -m agentstream.trainer` or `agentstream train`."""
