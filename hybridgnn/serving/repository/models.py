"""The registry of the models a server serves, by name and version (one entry for a
single-model server; every chosen version of a repository's models otherwise)."""

from __future__ import annotations

from hybridgnn.errors import NotFound, brief


class Models:
    """The engines a server serves, by model name and version (strings, as requests name
    them). A request without a version gets the highest one."""

    def __init__(self):
        self._engines: dict[str, dict[str, object]] = {}
        self._highest: dict[str, object] = {}  # name -> its highest version's engine (what most requests get)
        self.unavailable: dict[tuple[str, str], str] = {}  # (name, version) -> why it is not served

    def add(self, name: str, version: str, engine) -> None:
        self._engines.setdefault(name, {})[version] = engine
        self._note_highest(name)

    def _note_highest(self, name: str) -> None:
        versions = self._engines.get(name)
        if versions:
            self._highest[name] = versions[max(versions, key=_version_key)]
        else:
            self._highest.pop(name, None)

    def get(self, name: str, version: str | None = None):
        """The engine of model `name` (version: that one, else the highest); NotFound
        naming what this server serves."""
        if version is None:
            engine = self._highest.get(name)
            if engine is not None:
                return engine
        versions = self._engines.get(name)
        if not versions:
            raise NotFound(f"unknown model {brief(name)}; this server serves {sorted(self._engines)}")
        engine = versions.get(version)
        if engine is None:
            raise NotFound(f"model {name!r} has no version {brief(version)}; versions: "
                           f"{sorted(versions, key=_version_key)}")
        return engine

    def remove(self, name: str, version: str):
        """Stop routing to (name, version); returns its engine."""
        engine = self._engines[name].pop(version)
        if not self._engines[name]:
            del self._engines[name]
        self._note_highest(name)
        return engine

    def versions(self, name: str) -> list[str]:
        return sorted(self._engines.get(name, {}), key=_version_key)

    def names(self) -> list[str]:
        return sorted(self._engines)

    def engines(self) -> list:
        return [e for versions in self._engines.values() for e in versions.values()]

    def items(self):
        """(name, version, engine), in name then version order."""
        for name in self.names():
            for version in self.versions(name):
                yield name, version, self._engines[name][version]


def _version_key(v: str) -> tuple[int, str]:
    return (int(v), v) if v.isdigit() else (-1, v)
