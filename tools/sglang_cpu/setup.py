"""Build hook: ship `megatron_rl_sglang_cpu.pth` at the top of site-packages (setuptools has no declarative
way to install a .pth file next to the modules; the .pth imports the torchvision guard at start-up)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "megatron_rl_sglang_cpu.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildWithPth})
