"""Debian packages the tests need and install when missing (as root, from the distribution's registry)."""
import os
import subprocess


def install_debian(package, timeout=300):
    """``apt-get install PACKAGE`` (after an ``apt-get update`` if the first try fails); raises on failure."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", package]
    if subprocess.run(install, timeout=timeout, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True, timeout=timeout, env=env, capture_output=True)
        subprocess.run(install, check=True, timeout=timeout, env=env, capture_output=True)
