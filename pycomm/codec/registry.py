"""The one registry of codecs, keyed by name: what ``pycomm.Exchange(codec)``,
``pycomm.wrap(hook=name)``, ``pycomm.fsdp.compress(codec=...)``, ``pycomm.LocalSGD`` and
``DiLoCo`` read. A codec registered once is usable by every one of them under its name.

:func:`register_codec` checks the codec (and runs it once, :func:`pycomm.codec.check_codec`)
when it is registered, so a bad one is an error there, not at the first exchange.
``pycomm.hooks.register_hook(name, codec=...)`` is the same registration, spelled as a hook.

A name registered in a module is known in every process that imports the module: import it
on every rank.

Example:
    >>> pycomm.codec.register_codec("topk", TopKCodec, description="top-k, 1%")
    >>> pycomm.Exchange("topk").all_reduce(delta, key="delta").wait()
    >>> ddp = pycomm.wrap(model, hook="topk")
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pycomm._validate import check_bool, check_int
from pycomm.codec.check import check_codec
from pycomm.codec.codecs import Codec

__all__ = [
    "ENGINE_DEFAULTS",
    "ENGINE_OPTIONS",
    "CodecSpec",
    "codec_identity",
    "codec_names",
    "codec_spec",
    "qualified_name",
    "register_codec",
    "unregister_codec",
]

NAME = re.compile(r"^[a-z][a-z0-9_]*$")

# the engine's options, which every codec takes beside its own
ENGINE_OPTIONS = (
    "start_iter", "error_feedback", "local_feedback", "residual_dtype", "strict_skip",
    "hierarchy",
)  # fmt: skip
# the engine's options a registered codec may give its own default for (``defaults=``)
ENGINE_DEFAULTS = ("start_iter", "error_feedback", "local_feedback")


@dataclass(frozen=True)
class CodecSpec:
    """A registered codec.

    Attributes:
        name: what ``pycomm.Exchange(codec)``, ``pycomm.wrap(hook=...)`` and the others take.
        codec: the :class:`~pycomm.codec.Codec` class (or factory); its keyword parameters,
            each with a default, are the codec's options.
        auto: whether ``hook="auto"`` may choose it.
        description: one line, shown by ``python -m pycomm.bench --list-hooks``.
        defaults: its own defaults of the engine's ``start_iter``, ``error_feedback`` and
            ``local_feedback``.
        bucket_cap_mb: the DDP bucket size ``pycomm.wrap`` picks for it (None: DDP's).
        advice: ``(state, optimizer) -> str or None``: why it trains worse with an optimizer.
        module: the module whose top level registered it: what another process imports to
            know it.

    Example:
        >>> pycomm.codec.codec_spec("int8").option_names
        ('block',)
    """

    name: str
    codec: Callable[..., Codec]
    auto: bool = False
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    bucket_cap_mb: Optional[float] = None
    advice: Optional[Callable[[Any, Any], Optional[str]]] = None
    module: str = ""

    @property
    def option_names(self) -> tuple[str, ...]:
        """The codec's own options: its factory's keyword parameters."""
        params = inspect.signature(self.codec).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return tuple(p.name for p in params if p.kind in kinds)


_CODECS: dict[str, CodecSpec] = {}
# names a registry above this one holds (DDP's hooks with a state of their own): name ->
# (its class, the module that registered it); no codec takes them
_RESERVED: dict[str, tuple[Any, str]] = {}


def reserve(name: str, owner: Any, module: str) -> None:
    """Hold ``name`` for ``owner`` (a class of a registry above this one, registered by
    ``module``): :func:`register_codec` then refuses it, so one name means one thing
    everywhere. :func:`release` gives it back."""
    _RESERVED[name] = (owner, module)


def release(name: str) -> None:
    """Give back a name :func:`reserve` held (nothing if it held none)."""
    _RESERVED.pop(name, None)


def _where(name: Any) -> str:
    return f"pycomm.codec.register_codec({name!r})"


def register_codec(
    name: str,
    codec: Callable[..., Codec],
    *,
    auto: bool = False,
    description: str = "",
    defaults: Optional[dict[str, Any]] = None,
    bucket_cap_mb: Optional[float] = None,
    advice: Optional[Callable[[Any, Any], Optional[str]]] = None,
    module: Optional[str] = None,
    where: Optional[str] = None,
) -> CodecSpec:
    """Register ``codec`` (a :class:`~pycomm.codec.Codec` class or factory whose keyword
    parameters, all with defaults, are its options) under ``name`` and return its
    :class:`CodecSpec`. It then gets everything the built-in codecs get, in every user of a
    codec: the two-phase exchange, error feedback, ``start_iter``, ``hierarchy``, the
    non-finite skip, stats and checkpoints.

    ``defaults``: its own defaults of the engine's ``start_iter``, ``error_feedback`` and
    ``local_feedback``; ``bucket_cap_mb``: the DDP bucket size ``pycomm.wrap`` picks when the
    caller gives none; ``advice``: a function ``(state, optimizer) -> str or None`` that says
    why the codec trains worse with that optimizer; ``module``: the module that registers it
    (default: the caller's); ``where``: how error messages start.

    Raises ValueError (naming the argument, the value and what is expected) for a taken name,
    a bad argument, or a codec that breaks the protocol (:func:`~pycomm.codec.check_codec`,
    run once on the CPU). The same module registering the same codec again (imported twice)
    returns the spec.

    Example:
        >>> pycomm.codec.register_codec("sign", SignCodec, defaults={"start_iter": 20})
    """
    where = where or _where(name)
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(
            f"{where}: name={name!r}, expected lowercase letters, digits and '_', starting "
            "with a letter ('-' and ':' are the bench's variant and module:factory names)"
        )
    if not callable(codec):
        raise ValueError(f"{where}: codec={codec!r}, expected a Codec class or factory")
    module = caller_module(__name__) if module is None else module
    if name in _RESERVED and _RESERVED[name][1] != module:
        owner, by = _RESERVED[name]
        taken(where, name, owner, by, codec=False)
    old = _CODECS.get(name)
    if old is not None and old.module != module:
        taken(where, old.name, old.codec, old.module)
    try:
        instance = codec()
    except TypeError as e:
        raise ValueError(
            f"{where}: codec={getattr(codec, '__name__', codec)!r} cannot be built "
            f"without arguments ({e}); expected defaults for every parameter"
        ) from e
    check_codec(instance, where)
    spec = CodecSpec(name, codec, auto, description, _check_defaults(where, defaults),
                     bucket_cap_mb, advice, module)  # fmt: skip
    clash = sorted(set(spec.option_names) & set(ENGINE_OPTIONS))
    if clash:
        raise ValueError(
            f"{where}: codec option {clash[0]!r} is also an option of the engine "
            f"({', '.join(ENGINE_OPTIONS)}); expected other parameter names"
        )
    if bucket_cap_mb is not None and (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not bucket_cap_mb > 0
    ):
        raise ValueError(f"{where}: bucket_cap_mb={bucket_cap_mb!r}, expected a number > 0")
    if advice is not None and not callable(advice):
        raise ValueError(
            f"{where}: advice={advice!r}, expected a function (state, optimizer) -> str or None"
        )
    if not isinstance(auto, bool):
        raise ValueError(f"{where}: auto={auto!r}, expected True or False")
    if not isinstance(description, str):
        raise ValueError(f"{where}: description={description!r}, expected a str (one line)")
    if old is not None and qualified_name(old.codec) != qualified_name(codec):
        taken(where, old.name, old.codec, old.module)
    _CODECS[name] = spec
    return spec


def _check_defaults(where: str, defaults: Any) -> dict[str, Any]:
    if defaults is not None and not isinstance(defaults, dict):
        raise ValueError(f"{where}: defaults={defaults!r}, expected a dict or None")
    out = dict(defaults or {})
    unknown = sorted(set(out) - set(ENGINE_DEFAULTS))
    if unknown:
        raise ValueError(
            f"{where}: defaults has {unknown[0]!r}, expected some of {', '.join(ENGINE_DEFAULTS)} "
            "(a codec's own options take their defaults from its signature)"
        )
    if "start_iter" in out:
        check_int(where, "defaults['start_iter']", out["start_iter"], 2)
    for key in ("error_feedback", "local_feedback"):
        if key in out:
            check_bool(where, f"defaults[{key!r}]", out[key])
    return out


def caller_module(*skip: str) -> str:
    """The module that called into the registry: the first frame outside this module and the
    modules named in ``skip`` (a registry above this one, whose callers register)."""
    frame = inspect.currentframe()
    skipped = {__name__, *skip}
    try:
        while frame is not None and frame.f_globals.get("__name__") in skipped:
            frame = frame.f_back
        return "" if frame is None else str(frame.f_globals.get("__name__", ""))
    finally:
        del frame


def taken(where: str, name: str, owner: Any, module: str, codec: bool = True) -> None:
    """The ValueError for a name another module registered (``owner``: its class)."""
    what = f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', repr(owner))}"
    raise ValueError(
        f"{where}: the name is taken by {'codec ' if codec else ''}{what}, registered by "
        f"module {module!r}; expected a new name (or unregister it first)"
    )


def unregister_codec(name: str) -> None:
    """Remove ``name`` from the registry (a KeyError if it is not there).

    Example:
        >>> pycomm.codec.unregister_codec("topk")
    """
    del _CODECS[name]


def codec_spec(name: Any, where: str = "pycomm") -> CodecSpec:
    """The spec of codec ``name``, or a ValueError naming it and the registered codecs.

    Example:
        >>> pycomm.codec.codec_spec("int8").codec
        <class 'pycomm.codec.codecs.Int8Codec'>
    """
    spec = _CODECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(
            f"{where}: codec={name!r} is not one of {', '.join(_CODECS)} (the registered "
            "codecs; pycomm.codec.register_codec adds one)"
        )
    return spec


def find_codec(name: Any) -> Optional[CodecSpec]:
    """The spec of codec ``name``, or None."""
    return _CODECS.get(name) if isinstance(name, str) else None


def codec_names(auto: Optional[bool] = None) -> list[str]:
    """The registered codecs in registration order; ``auto=True``: those auto may choose.

    Example:
        >>> pycomm.codec.codec_names()
        ['bf16', 'fp16', 'int8', 'fp8', 'int4', 'onebit']
    """
    return [n for n, s in _CODECS.items() if auto is None or s.auto == auto]


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a class or function (``?`` where it has none)."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def codec_identity(codec: Codec) -> dict[str, Any]:
    """What two ranks' codecs must agree on to exchange codes: the codec's class and its
    format (block, dtypes, phases, bytes of 8 blocks), so that a codec edited on one node, or
    one with another default, is named before the first collective instead of hanging it.

    Example:
        >>> codec_identity(pycomm.codec.Int8Codec())["codec"]
        'pycomm.codec.codecs.Int8Codec'
    """
    cls, m = type(codec), 8 * codec.block
    return {
        "codec": f"{cls.__module__}.{cls.__qualname__}",
        "codec format": (
            f"block {codec.block}, codes {codec.code_dtype}, scales {codec.scale_dtype}, "
            f"{'two-phase' if codec.two_phase else 'one-phase'}, "
            f"{codec.code_bytes(m)} + {codec.scale_bytes(m)} bytes per {m} elements"
        ),
    }
