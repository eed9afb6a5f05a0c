"""The installed fnpipe's version (plan caches and checkpoints record it)."""
from __future__ import annotations

from pathlib import Path


def fnpipe_version() -> str:
    """The installed fnpipe's version, or the checkout's pyproject version."""
    import importlib.metadata

    try:
        return importlib.metadata.version("fnpipe")
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        if pyproject.exists():
            return tomllib.loads(pyproject.read_text())["project"]["version"]
        return "unknown"
