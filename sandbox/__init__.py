"""Isolation for code an agent runs: one contract (`sandbox.contract`), two backends.

- `sandbox.local`: bubblewrap on this machine (no network, read-only system, the workspace the only
  writable place, private /tmp, own pid namespace, rlimits, wall-clock limits);
- `sandbox.kubernetes`: the same contract as a Pod spec plus a default-deny egress NetworkPolicy.
"""
