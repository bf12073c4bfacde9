"""Telling which algorithm saved an optimizer state_dict, and refusing to load another
algorithm's checkpoint with a message that says so. State dicts come from real optimizers,
torch's and ours, after a step (and before the first one, when the state is empty)."""

import pytest
import torch

import pagedoptim as po
from support import LionReference, make_params, set_grads
from pagedoptim.checkpoint.algorithms import check_algorithm, identify_algorithm

from optimizer_configs import ALGORITHM_OF

SHAPES = [(5, 13), (33,)]

# name -> (constructor, what identify_algorithm must say)
SAVERS = {
    "torch.AdamW": (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "adamw"),
    "torch.AdamW-amsgrad": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True), "adamw"),
    "torch.Adam": (lambda ps: torch.optim.Adam(ps, lr=1e-3), "adam"),
    "torch.Adam-decay": (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1), "adam"),
    "torch.SGD": (lambda ps: torch.optim.SGD(ps, lr=0.1), "sgd"),
    "torch.SGD-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd"),
    "LionReference": (lambda ps: LionReference(ps, lr=1e-4), "lion"),
    "po.AdamW": (lambda ps: po.AdamW(ps), "adamw"),
    "po.AdamW-32": (lambda ps: po.AdamW(ps, state_bits=32, master_bits=None), "adamw"),
    "po.SGD": (lambda ps: po.SGD(ps, lr=0.1, momentum=0.9), "sgd"),
    "po.Lion": (lambda ps: po.Lion(ps), "lion"),
    "po.SkewAdam": (lambda ps: po.SkewAdam(ps), "skewadam"),
}
# One saver per kind pagedoptim has, for the load matrix (the shared table's algorithms).
OURS_BY_KIND = {algorithm: cls for cls, algorithm in ALGORITHM_OF.items()}
CLASS_NAME = {algorithm: cls.__name__ for cls, algorithm in ALGORITHM_OF.items()}


def saved_state_dict(saver, steps=1):
    params = make_params(SHAPES)
    opt = SAVERS[saver][0](params)
    for _ in range(steps):
        set_grads(params, [torch.randn_like(p) for p in params])
        opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("steps", [0, 1])
@pytest.mark.parametrize("saver", list(SAVERS))
def test_identifies_the_optimizer_that_saved_it(saver, steps):
    assert identify_algorithm(saved_state_dict(saver, steps)) == SAVERS[saver][1]


def test_engine_kinds_are_the_kinds_identified():
    """check_algorithm is called with the optimizers' `_kind`: they must be its names."""
    assert {kind: cls._kind for kind, cls in OURS_BY_KIND.items()} == {
        kind: kind for kind in OURS_BY_KIND}


@pytest.mark.parametrize("state, expected", [
    ({0: {"momentum_buffer": torch.zeros(3)}}, "sgd"),
    ({0: {"exp_avg_codes": torch.zeros(3, dtype=torch.int8),
          "exp_avg_sq_codes": torch.zeros(3, dtype=torch.uint8)}}, "adamw"),
    ({0: {"exp_avg_sq_row": torch.zeros(3), "exp_avg_sq_col": torch.zeros(3)}}, "skewadam"),
    ({0: {"exp_avg": torch.zeros(3)}}, "lion"),
    ({}, None),
    ({0: {"step": torch.tensor(1.0)}}, None),
])
def test_state_keys_decide_where_the_groups_cannot(state, expected):
    state_dict = {"state": state, "param_groups": [{"params": [0], "lr": 0.1}]}
    assert identify_algorithm(state_dict) == expected


@pytest.mark.parametrize("not_a_state_dict", [None, [1, 2], {"model": {}},
                                              {"state": {}, "param_groups": [{"lr": 1}]}])
def test_not_a_state_dict_is_a_clear_error(not_a_state_dict):
    with pytest.raises(ValueError, match="state_dict must be an optimizer state_dict"):
        identify_algorithm(not_a_state_dict)


@pytest.mark.parametrize("loader", list(OURS_BY_KIND))
@pytest.mark.parametrize("saver", list(SAVERS))
def test_check_algorithm_refuses_every_other_algorithm(saver, loader):
    state_dict = saved_state_dict(saver)
    saved_kind = SAVERS[saver][1]
    compatible = saved_kind == loader or (saver == "torch.Adam" and loader == "adamw")
    if compatible:
        check_algorithm(loader, state_dict, CLASS_NAME[loader])
        return
    with pytest.raises(ValueError, match=rf"saved by .*; pagedoptim\.{CLASS_NAME[loader]} "
                                         r"cannot load it"):
        check_algorithm(loader, state_dict, CLASS_NAME[loader])


def test_adam_with_weight_decay_is_refused_by_adamw_and_says_why():
    """torch.optim.Adam's weight decay is L2 through the moments, AdamW's decays the weight:
    resuming one as the other would silently change training. Without decay they agree."""
    with pytest.raises(ValueError, match=r"torch\.optim\.Adam with weight_decay != 0.*"
                                         r"a different algorithm.*; pagedoptim\.AdamW cannot"):
        check_algorithm("adamw", saved_state_dict("torch.Adam-decay"), "AdamW")
    check_algorithm("adamw", saved_state_dict("torch.Adam"), "AdamW")


def test_message_names_the_evidence():
    with pytest.raises(ValueError) as error:
        check_algorithm("adamw", saved_state_dict("po.SkewAdam"), "AdamW")
    message = str(error.value)
    assert message.startswith("this state_dict was saved by pagedoptim.SkewAdam")
    assert "'param_tiers'" in message and "'exp_avg_sq_row'" in message


def test_a_dotted_name_is_kept():
    with pytest.raises(ValueError, match=r"; my\.AdamW cannot load it"):
        check_algorithm("adamw", saved_state_dict("torch.SGD"), "my.AdamW")


def test_unknown_expected_kind_is_a_clear_error():
    with pytest.raises(ValueError, match=r"expected must be one of .*got 'adam'"):
        check_algorithm("adam", saved_state_dict("torch.AdamW"), "AdamW")


def test_cannot_tell_is_let_through():
    check_algorithm("lion", {"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]}, "Lion")


def test_loading_another_algorithms_checkpoint_raises():
    """The load path itself: fails until PagedOptimizer.load_state_dict calls
    check_algorithm(self._kind, state_dict, type(self).__name__) first."""
    adamw_state_dict = saved_state_dict("po.AdamW")
    skewadam = po.SkewAdam(make_params(SHAPES))
    with pytest.raises(ValueError, match=r"saved by AdamW .*; pagedoptim\.SkewAdam cannot "
                                         r"load it"):
        skewadam.load_state_dict(adamw_state_dict)


@pytest.mark.parametrize("torch_cls, name", [
    (torch.optim.RMSprop, "RMSprop"), (torch.optim.Adagrad, "Adagrad"),
    (torch.optim.Adadelta, "Adadelta"), (torch.optim.NAdam, "NAdam"),
    (torch.optim.RAdam, "RAdam"), (torch.optim.Adamax, "Adamax"), (torch.optim.Rprop, "Rprop"),
    (torch.optim.ASGD, "ASGD"),
])
@pytest.mark.parametrize("kind", list(OURS_BY_KIND))
def test_torchs_other_optimizers_are_refused_by_name(torch_cls, name, kind):
    """RMSprop has SGD's momentum key, Adagrad nothing Adam-like, RAdam Adam's betas and eps:
    none may pass for one of ours."""
    params = make_params(SHAPES)
    opt = torch_cls(params, momentum=0.9) if torch_cls is torch.optim.RMSprop else \
        torch_cls(params)
    set_grads(params, [torch.randn_like(p) for p in params])
    opt.step()
    state_dict = opt.state_dict()
    assert identify_algorithm(state_dict) == "other"
    with pytest.raises(ValueError, match=f"saved by .*{name}"):
        OURS_BY_KIND[kind](make_params(SHAPES)).load_state_dict(state_dict)
