"""Reward functions: math answers, code tests in a sandbox, exact/format checks (SDK issue)."""
