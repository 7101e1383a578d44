"""`agentstream demo` and what every preset of a loop shares: its typed description (`loop`), running it (`run`),
what it shows (`progress`); the demo itself is `preset`."""

from agentstream.demo.preset import DemoConfig, run_demo
from agentstream.demo.run import reset_weights

__all__ = ["DemoConfig", "reset_weights", "run_demo"]
