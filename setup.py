"""Ship the top-level conf/ inside the wheel as lifecycle/conf (an installed lifecycle finds its presets).

Everything else is in pyproject.toml; this file only copies conf/ into the build tree of a wheel.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConf(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "lifecycle" / "conf"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(Path(__file__).parent / "conf", target)


setup(cmdclass={"build_py": BuildWithConf})
