"""Where the modules of the flat layout went, so old names keep importing.

Until the package was cut into layers (state/, paging/, engine/, checkpoint/, optim/,
integrations/, reference/, cli/) every module sat directly in pagedoptim/. Pickles of our
optimizers name their classes by those old modules (`pagedoptim.adamw.AdamW`,
`pagedoptim.options.PagingOptions`, `pagedoptim.stand_ins.AdamW`), and so may users' imports
(`from pagedoptim.reference import ...` still works as it is). A meta path finder answers
each old name with the module that now holds it: the same module object, registered under
both names, so a class unpickled through the old name is the class itself. Nothing is
imported until an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Optional

MOVED = {
    "state_format": "state.format",
    "sharded_params": "state.sharding",
    "state_dict_checks": "state.checks",
    "param_state": "state.param_state",
    "options": "paging.options",
    "env_settings": "paging.env_settings",
    "paging_kwargs": "paging.kwargs",
    "setting_text": "paging.setting_text",
    "state_plan": "paging.state_plan",
    "compiled_step": "engine.compiled_step",
    "interrupted_step": "engine.interrupted_step",
    "release_guard": "engine.release_guard",
    "lifecycle": "engine.lifecycle",
    "atomic_file": "checkpoint.atomic_file",
    "checkpoint_format": "checkpoint.format",
    "checkpoint_stream": "checkpoint.stream",
    "checkpoint_algorithms": "checkpoint.algorithms",
    "checkpoint_conversion": "checkpoint.conversion",
    "optimizer": "optim.optimizer",
    "adamw": "optim.adamw",
    "sgd": "optim.sgd",
    "lion": "optim.lion",
    "skewadam": "optim.skewadam",
    "torch_flags": "optim.torch_flags",
    "tiers": "optim.tiers",
    "trainer_route_check": "optim.trainer_route_check",
    "dcp": "integrations.dcp",
    "patch": "integrations.patch",
    "wrap": "integrations.wrap",
    "stand_ins": "integrations.stand_ins",
    "owning_model": "integrations.owning_model",
    "torch_optimizer_guard": "integrations.torch_optimizer_guard",
    "reference_skewadam": "reference.skewadam",
    "bench": "cli.bench",
    "bench_plot": "cli.bench_plot",
    "demo": "cli.demo",
    "demo_plot": "cli.demo_plot",
    "plan": "cli.plan",
    "convert": "cli.convert",
    "progress": "cli.progress",
    "machine_profile": "cli.machine_profile",
    "link_bandwidth": "cli.link_bandwidth",
    "memory_bandwidth": "cli.memory_bandwidth",
    "timing": "cli.timing",
    "step_modes": "cli.step_modes",
    "memory_plan": "cli.memory_plan",
    "model_shapes": "cli.model_shapes",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new_name: str) -> None:
        self._new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(self._new_name)

    def exec_module(self, module: Any) -> None:
        pass  # the module ran under its new name


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, old = fullname.partition(".")
        if package != "pagedoptim" or old not in MOVED:
            return None
        new_name = f"pagedoptim.{MOVED[old]}"
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new_name))


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
