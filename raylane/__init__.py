"""raylane: a Ray-based LLM serving cluster.

The packages live in the repository's top-level folders (`engine/`, `deployments/`, ...) and install
under this root (`raylane.engine`, `raylane.deployments`, ...): see pyproject's package-dir.
"""
