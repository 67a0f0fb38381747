"""Packages for setuptools (the project's metadata is in pyproject.toml).

The stage folders stay at the repository's top level (core/, training/, index/, service/) but install
under the project's own namespace, as icr.core, icr.training, icr.index and icr.service, beside the
CLI in icr/: a
user's own top-level `training` or `service` package can never clash with ours. bench/ and the tests
are not installed.
"""

from setuptools import find_packages, setup

STAGES = ("core", "training", "index", "service")

setup(
    packages=["icr", *(f"icr.{name}" for name in find_packages(include=[f"{s}*" for s in STAGES]))],
    package_dir={"icr": "icr", **{f"icr.{stage}": stage for stage in STAGES}},
    package_data={
        "icr": ["demo_weights/*"],  # the demo model `icr demo` serves (SHIPPED.json says how it was made)
        "icr.training": ["configs/*.toml"],
        "icr.service": ["static/*"],  # the search page
    },
)
