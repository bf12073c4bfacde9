"""The paging keyword arguments every PagedOptim optimizer takes (state_bits ...
release_grads), for the entry points that forward them: patch() and wrap()."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pagedoptim.paging.options import PagingOptions

NAMES = tuple(field.name for field in dataclasses.fields(PagingOptions))


def check_names(kwargs: Mapping[str, Any], caller: str) -> None:
    """Raises TypeError unless every key of `kwargs` is a paging keyword argument (their
    values are checked where they are merged with the other sources of settings)."""
    unknown = sorted(set(kwargs) - set(NAMES))
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"it takes the paging keyword arguments {', '.join(NAMES)}")


def with_defaults(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every paging keyword argument: `kwargs`, and the optimizers' defaults for the rest."""
    return {**dataclasses.asdict(PagingOptions()), **kwargs}
