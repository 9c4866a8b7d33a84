"""`pip install -e .` prints no setuptools deprecation box: the project metadata in
pyproject.toml is read by setuptools without a single SetuptoolsDeprecationWarning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import warnings
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution
from setuptools.warnings import SetuptoolsDeprecationWarning

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist = apply_configuration(Distribution(), "pyproject.toml")
print(dist.metadata.license_expression)
for warning in caught:
    if issubclass(warning.category, SetuptoolsDeprecationWarning):
        print("DEPRECATION", warning.message)
"""


def test_pyproject_reads_without_setuptools_deprecations():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "Apache-2.0"
    assert "DEPRECATION" not in result.stdout, result.stdout
