"""Metadata lives in pyproject.toml; this file lets older tools build the package."""

from setuptools import setup

setup()
