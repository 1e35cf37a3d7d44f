"""Each rank starts a `sleep 60` grandchild, notes its pid and exits 0 without waiting for it."""

import subprocess

from _common import note

child = subprocess.Popen(["sleep", "60"])
note("grandchild", child.pid)
