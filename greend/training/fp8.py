"""fp8 through torchao: a model's eligible linears converted to ``Float8Linear`` and back,
in place, keeping every Parameter object (an optimizer built before keeps its state)."""

from __future__ import annotations

import importlib
import logging
import sys

from torch import nn

__all__ = ["Fp8Converter", "warm_up_torchao"]

log = logging.getLogger(__name__)


def warm_up_torchao() -> None:
    """Import torchao's float8 module (about 3 s on a small CPU), so that the first step at
    fp8 does not pay for it. On the caller's thread: it imports torch._dynamo and
    torch._inductor, and on a thread of its own it raced a torch.compile on the user's
    next line (the race the callback's own warm-up had)."""
    if "torchao.float8" in sys.modules:
        return
    try:
        importlib.import_module("torchao.float8")
    except Exception as e:
        log.debug("warming up torchao.float8 failed: %s", e)


# The module's own hooks (forward, backward, state dict): the dicts are shared with the
# converted module, so the job's hooks (activation monitors, a checkpointing hook) fire at
# fp8 too, and a hook added or removed meanwhile is the original's as well.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _share_hooks(orig: nn.Module, new: nn.Module) -> None:
    for name in _HOOK_DICTS:
        hooks = getattr(orig, name, None)
        if hooks is not None:
            setattr(new, name, hooks)
    new._is_full_backward_hook = orig._is_full_backward_hook


class Fp8Converter:
    """Converts a model's eligible linears to torchao Float8Linear and back, in place.

    ``convert()`` keeps the original ``nn.Linear`` module objects; ``revert()`` puts
    them back. Both keep every Parameter object (checked: a conversion that would
    replace one is undone and raises), so an optimizer built before the switch
    keeps working, state included.
    """

    def __init__(self, model: nn.Module, targets: list[str], *, emulate: bool) -> None:
        self.model = model
        self.targets = list(targets)
        self.emulate = emulate
        self._originals: dict[str, nn.Linear] = {}

    @property
    def active(self) -> bool:
        return bool(self._originals)

    def convert(self) -> int:
        """Convert; returns the number of layers converted. Raises on failure (model unchanged)."""
        if self.active:
            return len(self._originals)
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        config = Float8LinearConfig(emulate=self.emulate)
        params_before = [id(p) for p in self.model.parameters()]
        done: dict[str, nn.Linear] = {}
        try:
            for name in self.targets:
                parent, attr = self._parent(name)
                orig = getattr(parent, attr)
                if type(orig) is not nn.Linear:
                    continue
                new = Float8Linear.from_float(orig, config=config)
                if new.weight is not orig.weight or new.bias is not orig.bias:
                    raise RuntimeError(f"torchao replaced the parameters of {name}: the optimizer would lose them")
                _share_hooks(orig, new)
                setattr(parent, attr, new)
                done[name] = orig
        except Exception:
            self._originals = done
            self.revert()
            raise
        self._originals = done
        if [id(p) for p in self.model.parameters()] != params_before:  # pragma: no cover - defensive
            self.revert()
            raise RuntimeError("fp8 conversion changed the model's Parameter objects")
        return len(done)

    def revert(self) -> None:
        """Put the original nn.Linear modules back (same Parameters, same hooks)."""
        for name, orig in self._originals.items():
            parent, attr = self._parent(name)
            cur = getattr(parent, attr)
            if cur is not orig:
                # The Float8Linear shares the Parameters; re-point the original should
                # someone have re-assigned them in the meantime.
                if getattr(cur, "weight", None) is not None and cur.weight is not orig.weight:
                    orig.weight = cur.weight
                if getattr(cur, "bias", None) is not orig.bias:
                    orig.bias = cur.bias
                orig.train(cur.training)
                # (a full backward hook registered on the converted module set its flag there)
                orig._is_full_backward_hook = getattr(cur, "_is_full_backward_hook", orig._is_full_backward_hook)
                setattr(parent, attr, orig)
        self._originals = {}

    def _parent(self, name: str) -> tuple[nn.Module, str]:
        if "." in name:
            path, attr = name.rsplit(".", 1)
            return self.model.get_submodule(path), attr
        return self.model, name
