"""ACME's house lifecycle policies: a policy pack (entry-point group ``lifecycle.policy_packs``).

lifecycle imports this module to read the schema version, so it must stay free of torch.
"""

LIFECYCLE_SCHEMA_VERSION = 1
"""The lifecycle policy schema these YAML files target; lifecycle refuses the pack on a mismatch."""
