"""The web dashboard over the log: overview, rollouts, one trajectory down to its tokens, compare versions.

Everything it shows is read from the topics through the SQL layer (`agentstream.logs.query`), bounded by
a time range and a limit; live updates come from a follower of the topics, sent as server-sent events.
"""
