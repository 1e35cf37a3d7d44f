"""The library's version and the policy schema version it reads (defined here, low in the import graph, so the
policy layer and policy packs can name them without importing the package's public face)."""

LIBRARY_VERSION = "0.2.0"
"""Keep equal to pyproject.toml's ``version`` (a test checks)."""
SCHEMA_VERSION = 1
"""The policy schema version this library reads (``schema_version`` in a policy; ``LIFECYCLE_SCHEMA_VERSION`` in a pack)."""
