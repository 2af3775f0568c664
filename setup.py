"""`pip install` builds the device code (python -m pyhipa2a.build) into the package."""
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        here = Path(__file__).resolve().parent
        # Editable installs import from the source tree, so the code objects go there.
        out = here / "pyhipa2a" / "_code" if self.editable_mode else Path(self.build_lib) / "pyhipa2a" / "_code"
        subprocess.check_call([sys.executable, str(here / "pyhipa2a" / "build.py"), "--out", str(out)])


setup(cmdclass={"build_py": BuildPyWithKernels})
