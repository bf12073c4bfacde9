"""SkewAdam's parameter tiers and the name patterns that assign them.

A Mixture-of-Experts model has three kinds of weights, and SkewAdam keeps different state
for each (docs/skewadam.md):

  backbone  dense weights every token uses (attention, embeddings, shared experts, norms)
  experts   routed expert weights, each seeing a fraction of the tokens; [E, rows, cols]
            tensors (transformers >= 5 fuses the experts of a layer into one) or one 2-D
            tensor per expert (older checkpoints: ``experts.3.w1.weight``)
  router    the gate that picks the experts, small and sensitive to noise

A parameter's tier comes from its group's ``tier`` key when the group has one, otherwise
from its name (``named_parameters()``, or SkewAdam's ``names_from=model`` for parameters given
without names): the first tier, router then experts, with a pattern
that ``re.search``-es the name; everything else is backbone. The defaults recognize the
naming of transformers' Mixtral (``mlp.gate`` / ``block_sparse_moe.gate``,
``mlp.experts.gate_up_proj`` / ``block_sparse_moe.experts.N.w1``), Qwen2-MoE (``mlp.gate``,
``mlp.shared_expert_gate``, ``mlp.experts...``; ``mlp.shared_expert...`` is backbone) and
DeepSeek-V3 (``mlp.gate`` with ``e_score_correction_bias``, ``mlp.experts...``;
``mlp.shared_experts...`` is backbone). They match whole dotted name components, so a dense
MLP's ``gate_proj`` is neither a router nor an expert.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import torch

BACKBONE = "backbone"
EXPERTS = "experts"
ROUTER = "router"
TIERS = (BACKBONE, EXPERTS, ROUTER)

DEFAULT_TIER_PATTERNS: dict[str, tuple[str, ...]] = {
    # A component named gate / router / shared_expert_gate: the router's weight (and bias,
    # and DeepSeek-V3's e_score_correction_bias should it be a parameter).
    ROUTER: (r"(?:^|\.)(?:gate|router|shared_expert_gate)(?:\.|$)",),
    # A component named experts: fused [E, rows, cols] tensors and per-expert modules alike;
    # shared_expert(s) does not match, it is dense.
    EXPERTS: (r"(?:^|\.)experts(?:\.|$)",),
}

# The order in which patterns are tried.
_PATTERN_ORDER = (ROUTER, EXPERTS)


def check_tier(tier: Any, argument: str = "tier") -> str:
    if tier not in TIERS:
        raise ValueError(f"Invalid {argument}: {tier!r} (expected one of {list(TIERS)})")
    return tier


def compile_tier_patterns(tiers: Optional[Mapping[str, Any]]
                          ) -> dict[str, tuple[re.Pattern[str], ...]]:
    """The patterns of the `tiers` argument: None for the defaults, or a mapping from
    'router' / 'experts' to a regular expression or a list of them, which replaces that
    tier's defaults (the other tier keeps its own; an empty list turns it off)."""
    if tiers is not None and not isinstance(tiers, Mapping):
        raise TypeError(f"tiers must be None or a mapping from tier name to patterns, "
                        f"got {type(tiers).__name__}")
    chosen: dict[str, Any] = dict(DEFAULT_TIER_PATTERNS)
    for tier, patterns in (tiers or {}).items():
        if tier not in _PATTERN_ORDER:
            raise ValueError(f"Invalid tiers key: {tier!r} (name patterns can assign "
                             f"{list(_PATTERN_ORDER)}; every other parameter is "
                             f"'{BACKBONE}')")
        chosen[tier] = (patterns,) if isinstance(patterns, (str, re.Pattern)) else patterns
    compiled: dict[str, tuple[re.Pattern[str], ...]] = {}
    for tier in _PATTERN_ORDER:
        entries = []
        for pattern in chosen[tier]:
            if not isinstance(pattern, (str, re.Pattern)):
                raise TypeError(f"tiers[{tier!r}] must hold regular expressions (str or "
                                f"re.Pattern), got {type(pattern).__name__}")
            try:
                entries.append(re.compile(pattern))
            except re.error as error:
                raise ValueError(f"Invalid tiers[{tier!r}] pattern {pattern!r}: {error}") from error
        compiled[tier] = tuple(entries)
    return compiled


def tier_of_name(name: str, patterns: Mapping[str, tuple[re.Pattern[str], ...]]) -> str:
    for tier in _PATTERN_ORDER:
        if any(pattern.search(name) for pattern in patterns[tier]):
            return tier
    return BACKBONE


def names_by_param(model: Optional[torch.nn.Module]) -> Optional[dict[torch.Tensor, str]]:
    """Each parameter of `model` (the `model` argument) mapped to its name, so parameters
    handed over without names (Trainer's groups) can still be put in tiers by name."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"names_from must be a torch.nn.Module (the model whose parameters are "
                        f"optimized), got {type(model).__name__}")
    # Tied weights appear once, under their first name, as in named_parameters().
    return {p: name for name, p in model.named_parameters()}
