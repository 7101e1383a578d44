"""The coding-agent recipe: SWE-bench-format tasks, a bug-injecting task builder, the grader, eval."""
