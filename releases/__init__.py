"""The canary decision service: reward, errors and latency by version from the log, a rule, a decision event."""
