"""The packages that ship: every package under memplan/ and calibrate/, found rather than listed
(a new subpackage ships without an edit here), plus the data tables as ``memplan._tables``
(``package_dir`` in setup.cfg, which holds everything else). Not validation/: the project's own
accuracy harness (matrices, probes, campaigns and their records) runs from a checkout. tests/test_packaging.py
checks the list against the tree."""

from setuptools import find_packages, setup

SOURCES = ("memplan", "memplan.*", "calibrate", "calibrate.*")

setup(packages=[*find_packages(include=SOURCES), "memplan._tables"])
