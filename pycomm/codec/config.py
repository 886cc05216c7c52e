"""A codec's options, resolved: the engine's (``start_iter``, ``error_feedback``,
``local_feedback``, ``residual_dtype``, ``strict_skip``, ``hierarchy``), each checked and with
its default filled in, and the codec's own, the codec built from them.

:class:`Config` is what the ranks compare and a checkpoint records (:meth:`Config.options`),
and what builds the :class:`~pycomm.codec.engine.Engine`. ``pycomm.Exchange``,
``pycomm.fsdp`` and DDP's codec hooks resolve their options here alike.

Example:
    >>> cfg = resolve(codec_spec("int8"), "pycomm.Exchange", {"block": 32})
    >>> cfg.options()["block"], cfg.codec.block
    (32, 32)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from pycomm._validate import check_bool, check_dtype, check_int
from pycomm.codec.check import check_codec
from pycomm.codec.codecs import Codec
from pycomm.codec.engine import Engine
from pycomm.codec.registry import ENGINE_OPTIONS, CodecSpec, codec_identity

__all__ = [
    "HIERARCHIES", "RESIDUAL_DTYPES", "Config", "build_codec", "check_hierarchy",
    "codec_options", "engine_options", "resolve",
]  # fmt: skip

RESIDUAL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
HIERARCHIES = ("auto", "flat", "node")
# the gradient dtypes the engine encodes from
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_hierarchy(where: str, value: Any) -> str:
    """``value`` if it is a valid ``hierarchy`` option, else a ValueError naming it."""
    if not isinstance(value, str) or value not in HIERARCHIES:
        raise ValueError(f"{where}: hierarchy={value!r}, expected one of 'auto', 'flat', 'node'")
    return value


def engine_options(where: str, options: dict[str, Any], defaults: dict[str, Any]) -> dict:
    """The engine's residual options from ``options``, each checked, with ``defaults``
    (``error_feedback``, ``local_feedback``) where not given."""
    return {
        "error_feedback": check_bool(
            where, "error_feedback", options.get("error_feedback", defaults["error_feedback"])
        ),
        "local_feedback": check_bool(
            where, "local_feedback", options.get("local_feedback", defaults["local_feedback"])
        ),
        "residual_dtype": check_dtype(
            where,
            "residual_dtype",
            options.get("residual_dtype", "float32"),
            tuple(RESIDUAL_DTYPES),
        ),  # fmt: skip
        "strict_skip": check_bool(where, "strict_skip", options.get("strict_skip", False)),
    }


def build_codec(
    where: str, factory: Callable[..., Codec], names: tuple, options: dict[str, Any]
) -> tuple[Codec, dict[str, Any]]:
    """The codec ``factory`` builds from the options of ``options`` it takes (``names``),
    checked (:func:`~pycomm.codec.check_codec`), and those options. A codec's refusal of
    an option is a ValueError starting with ``where``."""
    kwargs = {k: options[k] for k in names if k in options}
    try:
        codec = factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {_refusal(str(e), kwargs)}") from e
    check_codec(codec, where)
    return codec, kwargs


def codec_options(factory: Callable[..., Codec], names: tuple, given: dict) -> dict[str, Any]:
    """A codec's options as it runs them (its factory's defaults filled in, a dtype by its
    name: ``"bfloat16"`` and ``torch.bfloat16`` are one option value)."""
    sig = inspect.signature(factory)
    out = {k: given.get(k, sig.parameters[k].default) for k in names}
    return {k: _named(v) for k, v in out.items()}


def _named(value: Any) -> Any:
    """A dtype as its name (``"bfloat16"``), any other option value as it is."""
    return str(value).split(".")[-1] if isinstance(value, torch.dtype) else value


def _refusal(message: str, kwargs: dict[str, Any]) -> str:
    """A codec's refusal of its options as the caller's: ``block=12, expected ...`` when the
    codec's message names one of them after its own prefix, else the options and the message."""
    for name in kwargs:
        head, sep, rest = message.partition(": ")
        if sep and rest.startswith(f"{name}="):
            return rest
    return f"the codec refused options {kwargs}: {message}"


class Config:
    """A registered codec's options, resolved (see the module docstring).

    Attributes:
        name: the codec's registered name.
        codec: the codec built from its options.
        start_iter, hierarchy: the engine's warm-up and node hierarchy, as given.
        engine_options: ``error_feedback``, ``local_feedback``, ``residual_dtype`` and
            ``strict_skip``, checked.
    """

    grad_dtypes = FLOATS

    def __init__(
        self,
        spec: CodecSpec,
        where: str,
        options: dict[str, Any],
        start_iter: Optional[int] = None,
    ) -> None:
        names = spec.option_names
        unknown = [k for k in options if k not in (*ENGINE_OPTIONS, *names)]
        if unknown:
            raise ValueError(
                f"{where}: unknown option {unknown[0]!r}; valid options: "
                f"{', '.join((*ENGINE_OPTIONS, *names))}"
            )
        self.name, self.spec = spec.name, spec
        self.hierarchy = check_hierarchy(where, options.get("hierarchy", "auto"))
        defaults = {"error_feedback": True, "local_feedback": True, "start_iter": 2}
        defaults.update(spec.defaults)
        if start_iter is None:
            given = options.get("start_iter", defaults["start_iter"])
            start_iter = check_int(where, "start_iter", given, 2)
        self.start_iter = start_iter
        self.engine_options = engine_options(where, options, defaults)
        self.codec, self.codec_kwargs = build_codec(where, spec.codec, names, options)

    def options(self) -> dict[str, Any]:
        """Every option with its default filled in: what the ranks compare and a
        checkpoint's fingerprint records."""
        e = self.engine_options
        return {
            "start_iter": self.start_iter,
            "error_feedback": e["error_feedback"],
            "local_feedback": e["local_feedback"],
            "residual_dtype": RESIDUAL_DTYPES[e["residual_dtype"]],
            "strict_skip": e["strict_skip"],
            "hierarchy": self.hierarchy,
            **codec_options(self.spec.codec, self.spec.option_names, self.codec_kwargs),
        }

    def identity(self) -> dict[str, Any]:
        """The codec's class and format (:func:`~pycomm.codec.registry.codec_identity`)."""
        return codec_identity(self.codec)

    def fields(self) -> dict[str, Any]:
        """What the ranks compare (:func:`~pycomm.codec.agree.agree`): the codec's class,
        every option with its default, then the codec's format (a difference in both is
        named as the option)."""
        identity = self.identity()
        fields = {"codec class": identity["codec"]}
        fields.update({f"option {k!r}": v for k, v in self.options().items()})
        return {**fields, "codec format": identity["codec format"]}

    def engine(self, where: str, stats: dict[str, Any], nonfinite: str = "nonfinite") -> Engine:
        """A new engine of this codec and these options, counting into ``stats`` (its
        non-finite decodes under ``nonfinite``)."""
        return Engine(where, self.codec, stats, **self.engine_options, nonfinite=nonfinite)


def resolve(
    spec: CodecSpec, where: str, options: dict[str, Any], start_iter: Optional[int] = None
) -> Config:
    """``options`` of codec ``spec`` resolved (a ValueError or TypeError starting with
    ``where`` for an unknown option or a bad value). ``start_iter``: the caller's own warm-up,
    in place of the option."""
    return Config(spec, where, options, start_iter)
