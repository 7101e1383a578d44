"""End-to-end recipes built from the parts (`agentstream recipe …`)."""
