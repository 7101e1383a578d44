"""Isolation for code an agent runs: one contract (`sandbox.contract`), two backends.

- `sandbox.local`: bubblewrap on this machine (no network, read-only system, the workspace the only
  writable place and on a disk of its own, private /tmp, own pid namespace, a cgroup for the totals,
  rlimits, wall-clock limits); `sandbox.hostfs` is how the host walks any tree an agent wrote;
- `sandbox.kubernetes`: the same contract as a Pod spec plus a default-deny egress NetworkPolicy.
"""
