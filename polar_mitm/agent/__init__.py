"""The reference agent: a minimal tool-calling loop over each provider's official SDK (the `sdk:PROVIDER` harnesses,
`python -m polar_mitm.agent.cli`)."""
