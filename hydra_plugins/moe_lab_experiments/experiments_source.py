"""Hydra config source serving the studies in ``experiments/`` as the ``experiment`` group.

``conf/train.yaml`` puts ``experiments://moe_lab`` on the search path; this source then answers

    experiment/<study>.yaml            from experiments/<study>/preset.yaml   (+experiment=grid_30b)
    experiment/<study>/<variant>.yaml  from experiments/<study>/<variant>.yaml (+experiment=grid_30b/seq8192)
    experiment/<name>.yaml             from experiments/<name>.yaml            (shared presets: benchmark)

``experiments/`` is found next to the named package's modules: ``moe_lab/experiments`` links to the checkout's
``experiments/`` and is a copy of its presets in an installed wheel. Nothing deeper than a study's own folder is
served (its records hold Hydra's yaml too).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from omegaconf import OmegaConf

GROUP = "experiment"
PRESET = "preset.yaml"


class ExperimentsConfigSource(ConfigSource):
    @staticmethod
    def scheme() -> str:
        return "experiments"

    @property
    def root(self) -> Path | None:
        spec = importlib.util.find_spec(self.path)  # self.path: the package name after experiments://
        locations = spec.submodule_search_locations if spec else None
        return Path(locations[0], "experiments") if locations else None

    def _file(self, config_path: str) -> Path | None:
        """The yaml serving ``experiment/<name>[/<variant>]``, or None."""
        group, _, name = config_path.removesuffix(".yaml").partition("/")
        if group != GROUP or not name or self.root is None or name.count("/") > 1:
            return None
        folder = self.root / name
        path = folder / PRESET if "/" not in name and folder.is_dir() else self.root / f"{name}.yaml"
        return path if path.is_file() else None

    def available(self) -> bool:
        return self.root is not None and self.root.is_dir()

    def is_group(self, config_path: str) -> bool:
        if config_path in ("", GROUP):
            return self.available()
        group, _, study = config_path.partition("/")
        return group == GROUP and "/" not in study and self.root is not None and (self.root / study).is_dir()

    def is_config(self, config_path: str) -> bool:
        return self._file(config_path) is not None

    def load_config(self, config_path: str) -> ConfigResult:
        path = self._file(config_path)
        if path is None:
            raise ConfigLoadError(f"no study preset serves {config_path} under {self.root}")
        text = path.read_text()
        header = ConfigSource._get_header_dict(text)
        return ConfigResult(provider=self.provider, path=self.full_path(), config=OmegaConf.create(text), header=header)

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        if not self.available():
            return []
        if config_path == "":
            names = [GROUP]
        elif config_path == GROUP:
            names = [p.stem for p in self.root.glob("*.yaml")] + [p.parent.name for p in self.root.glob(f"*/{PRESET}")]
        else:
            study = config_path.removeprefix(f"{GROUP}/")
            names = [p.stem for p in (self.root / study).glob("*.yaml") if p.name != PRESET]
        files: list[str] = []
        for name in names:
            self._list_add_result(files, f"{config_path}/{name}".lstrip("/"), name, results_filter)
        return sorted(set(files))
