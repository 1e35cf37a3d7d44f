"""lifecycle: declarative lifecycle policies for Megatron-Core training jobs."""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
