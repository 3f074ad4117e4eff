"""The components live in dpopt.federated.flower (see pyproject.toml)."""
