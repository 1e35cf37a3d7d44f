"""The Megatron-Core backend: the only package of lifecycle that imports ``megatron.core``."""

import warnings

# Without Transformer Engine / Apex (CPU, or a lean GPU image) megatron-core warns on every import and
# model build, once per rank; the fallbacks are what we want, so keep the rank logs readable.
# 0.19 adds a few more at import (an experimental MIMO config, absl missing) and on load (torch's DCP argument order).
for _message in (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
                 ".*full scope is deprecated.*", ".*all_gather_into_tensor` is deprecated.*",
                 ".*MimoModelConfig is experimental.*", ".*absl.logging is not installed.*",
                 ".*The argument order of load has been changed.*"):
    warnings.filterwarnings("ignore", message=_message)

# Before megatron-core is imported: its jit_fuser (torch.compile) is left out where no GPU can use it (_jit.py).
from lifecycle.backends.megatron import _jit  # noqa: E402

_jit.install()
