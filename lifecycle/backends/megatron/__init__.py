"""The Megatron-Core backend: the only package of lifecycle that imports ``megatron.core``."""

import warnings

# Without Transformer Engine / Apex (CPU, or a lean GPU image) megatron-core warns on every import,
# once per rank; the fallbacks are what we want, so keep the rank logs readable.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
