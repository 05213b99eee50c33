"""GreenCallback's keyword arguments: CallbackOptions holds them, and the TypedDict a type
checker sees (CallbackKwargs) names the same ones with the same types."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from greend.training.callback import GreenCallback
from greend.training.options import CallbackKwargs, CallbackOptions


def test_the_typed_keywords_are_the_options_fields() -> None:
    # Both modules postpone their annotations: each type is compared as written.
    fields = {f.name: f.type for f in dataclasses.fields(CallbackOptions)}
    typed = {
        k: v.__forward_arg__ if isinstance(v, typing.ForwardRef) else v
        for k, v in CallbackKwargs.__annotations__.items()
    }
    assert typed == fields
    assert CallbackKwargs.__total__ is False


def test_an_unknown_keyword_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        GreenCallback(job="x", no_such_option=1)  # type: ignore[call-arg]  # the refusal is the point
