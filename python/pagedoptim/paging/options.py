"""The PagedOptim keyword arguments shared by every optimizer (state format and paging).

They are per optimizer, not per parameter group: the page layout is one for the whole
optimizer, and they must survive loading a torch.optim state_dict (whose groups carry
only torch's keys).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Optional

from pagedoptim._validation import check_non_negative
from pagedoptim.paging.setting_text import parse_byte_size
from pagedoptim.state.format import DEFAULT_MIN_8BIT_SIZE

PAGE_ALIGNMENT = 4096  # O_DIRECT and the native geometry need pages of whole 4 KiB
_POLICIES = ("auto", "lru", "plan")
_OFFLOAD_TIERS = (None, "host", "nvme")


@dataclasses.dataclass(frozen=True)
class PagingOptions:
    state_bits: int = 8
    master_bits: Optional[int] = 24
    # With state_bits=8, params of fewer elements (and 1-D and complex ones) keep fp32 moments
    # (state/format.py, keeps_8bit_state).
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE
    offload: Optional[str] = None
    nvme_dir: Optional[str] = None
    cache_bytes: Optional[int] = None
    page_bytes: Optional[int] = None  # None: chosen for the model (paging.choose_page_bytes)
    prefetch: int = 4
    policy: str = "auto"
    release_grads: bool = False
    # step() clips the gradients to this global 2-norm first, as clip_grad_norm_ would
    # (None: no clipping). With release_grads the norms are taken as gradients are released.
    max_grad_norm: Optional[float] = None

    def __post_init__(self) -> None:
        # Written the way the PAGEDOPTIM_* variables and optim_args take them: sizes as text
        # ("512MiB", "2GB"), names in any case, nvme_dir with "~". One spelling for a setting,
        # whichever way it is given.
        for name in ("cache_bytes", "page_bytes"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    object.__setattr__(self, name, parse_byte_size(value))
                except ValueError as error:
                    raise ValueError(f"Invalid {name}: {value!r} ({error})") from None
        for name in ("offload", "policy"):
            value = getattr(self, name)
            if isinstance(value, str):
                lowered = value.strip().lower()
                object.__setattr__(self, name, None if lowered == "none" else lowered)
        if isinstance(self.nvme_dir, (str, os.PathLike)):
            object.__setattr__(self, "nvme_dir", os.path.expanduser(os.fspath(self.nvme_dir)))
        if self.state_bits not in (8, 32):
            raise ValueError(f"Invalid state_bits: {self.state_bits!r} (expected 32 or 8)")
        if isinstance(self.min_8bit_size, bool) or not isinstance(self.min_8bit_size, int) \
                or self.min_8bit_size < 0:
            raise ValueError(f"Invalid min_8bit_size: {self.min_8bit_size!r} (expected an int "
                             ">= 0: the fewest elements a param keeps 8-bit moments for)")
        if self.master_bits not in (None, 24, 32):
            raise ValueError(f"Invalid master_bits: {self.master_bits!r} "
                             "(expected None, 24 or 32)")
        if self.offload not in _OFFLOAD_TIERS:
            raise ValueError(f"Invalid offload: {self.offload!r} (expected None, 'host' or 'nvme')")
        if self.nvme_dir is not None:
            if not isinstance(self.nvme_dir, (str, os.PathLike)):
                raise TypeError(f"nvme_dir must be a path, got {type(self.nvme_dir).__name__}")
            if self.offload == "host":
                raise ValueError("nvme_dir applies only to offload='nvme' (offload='host' keeps "
                                 "cold pages in host memory)")
        if self.cache_bytes is not None:
            if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int):
                raise TypeError(f"cache_bytes must be a number of bytes (an int, or a size such "
                                f"as '512MiB'), got {type(self.cache_bytes).__name__}")
            check_non_negative(self.cache_bytes, "cache_bytes")
        if self.page_bytes is not None and (
                isinstance(self.page_bytes, bool) or not isinstance(self.page_bytes, int)
                or self.page_bytes <= 0 or self.page_bytes % PAGE_ALIGNMENT):
            raise ValueError(f"Invalid page_bytes: {self.page_bytes!r} "
                             f"(expected None or a positive multiple of {PAGE_ALIGNMENT})")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) \
                or self.prefetch < 0:
            raise ValueError(f"Invalid prefetch: {self.prefetch!r} (expected an int >= 0)")
        if self.policy not in _POLICIES:
            raise ValueError(f"Invalid policy: {self.policy!r} (expected one of {_POLICIES})")
        # nvme_dir alone implies the page file (it says where pages go); a cache size alone
        # does not say where the pages beyond it go, and guessing the disk surprised users.
        # prefetch and policy alone have nothing to act on.
        paged = self.offload is not None or self.nvme_dir is not None
        if not paged and self.cache_bytes is not None:
            raise ValueError(f"cache_bytes={self.cache_bytes!r} sizes the page cache of paged "
                             "state, but nothing says where the pages beyond it go: set "
                             "offload='host' (pinned host memory, for params on a GPU) or "
                             "offload='nvme' (a page file; nvme_dir= names its directory) as "
                             "well")
        if not paged and self.prefetch != 4:
            raise ValueError(f"prefetch={self.prefetch!r} applies only to paged state: set "
                             "offload='host' or 'nvme' as well")
        if not paged and self.policy != "auto":
            raise ValueError(f"policy={self.policy!r} applies only to paged state: set "
                             "offload='host' or 'nvme' as well")
        if not isinstance(self.release_grads, bool):
            raise TypeError(f"release_grads must be a bool, got {type(self.release_grads).__name__}")
        norm = self.max_grad_norm
        if norm is not None:
            if isinstance(norm, bool) or not isinstance(norm, numbers.Real) \
                    or not norm > 0:  # NaN too
                raise ValueError(f"Invalid max_grad_norm: {norm!r} (expected None or a number "
                                 "> 0: the max_norm clip_grad_norm_ would clip the gradients "
                                 "to)")
            object.__setattr__(self, "max_grad_norm", float(norm))
