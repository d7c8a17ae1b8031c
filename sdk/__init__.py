"""What an environment writer touches: Environment, Session, the rollout runner (SDK issue)."""
