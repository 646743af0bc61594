"""Model repositories (Triton's layout) and the registry of served models and versions."""
