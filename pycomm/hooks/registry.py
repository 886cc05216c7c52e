"""The one registry of pycomm's hooks: what ``pycomm.wrap(hook=name)``, ``pycomm.register``,
``hook="auto"``'s candidates, ``python -m pycomm.bench --hooks/--list-hooks`` and
``python -m pycomm.bench.quality --hooks`` read.

A hook is a :class:`HookSpec`: a name, its state class, its hook function, its codec for the
compressed hooks, and whether ``auto`` may choose it. :func:`register_hook` checks a spec
(and runs the codec once, :func:`pycomm.hooks.check_codec`) when it is registered, so a bad
one is an error there, not at the first backward.

A name registered in a module is known in every process that imports the module: import it
on every rank (the bench and the quality suite take ``--import MODULE`` for that, and import
the modules of the hooks registered in the calling process on their ranks themselves).

Example:
    >>> pycomm.hooks.register_hook("topk", codec=TopKCodec, description="top-k, 1%")
    >>> ddp = pycomm.wrap(model, hook="topk", hook_options={"ratio": 0.01})
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pycomm._validate import check_bool, check_int
from pycomm.hooks.codec import check_codec
from pycomm.hooks.ddp import CompressedState, codec_identity, compressed_hook
from pycomm.hooks.state import HookState

__all__ = [
    "HookSpec",
    "hook_names",
    "hook_spec",
    "register_hook",
    "registration",
    "spec_identity",
    "unregister_hook",
]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class HookSpec:
    """A registered hook.

    Attributes:
        name: what ``pycomm.wrap(hook=...)`` and the bench take.
        state: the :class:`~pycomm.hooks.HookState` subclass, built as
            ``state(process_group, **hook_options)``.
        hook: the hook function, ``hook(state, bucket) -> Future[Tensor]``.
        codec: for a compressed hook, a factory of its codec at the hook's defaults (auto
            times it, and counts its bytes, to predict the hook's step time); else None.
        auto: whether ``hook="auto"`` may choose it (``allow=[...]``); its candidates are
            tried in registration order, the most exact first.
        description: one line, shown by ``python -m pycomm.bench --list-hooks``.
        module: the module whose top level registered it (the caller of
            :func:`register_hook`): what the bench's ranks import to know it.

    Example:
        >>> pycomm.hooks.hook_spec("int8").state
        <class 'pycomm.hooks.codec.Int8State'>
    """

    name: str
    state: type
    hook: Callable
    codec: Optional[Callable[[], Any]] = None
    auto: bool = False
    description: str = ""
    module: str = ""


_SPECS: dict[str, HookSpec] = {}


def _where(name: Any) -> str:
    return f"pycomm.hooks.register_hook({name!r})"


# the engine's options a registered codec may give its own default for (``defaults=``)
ENGINE_DEFAULTS = ("start_iter", "error_feedback", "local_feedback")


def _codec_state(
    name: str,
    factory: Callable[..., Any],
    defaults: dict[str, Any],
    bucket_cap_mb: Optional[float],
    advice: Optional[Callable[[Any, Any], Optional[str]]],
) -> type:
    """A CompressedState subclass for a registered codec: ``factory``'s keyword parameters
    are the hook's codec options; ``defaults``, ``bucket_cap_mb`` and ``advice`` its own
    defaults and optimizer advice."""
    params = [
        p
        for p in inspect.signature(factory).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    names = tuple(p.name for p in params)
    clash = sorted(set(names) & set(CompressedState.option_names))
    if clash:
        raise ValueError(
            f"{_where(name)}: codec option {clash[0]!r} is also an option of the engine "
            f"({', '.join(CompressedState.option_names)}); expected other parameter names"
        )
    title = "".join(part.title() for part in name.split("_"))
    label = getattr(factory, "__name__", None) or repr(factory)  # a functools.partial has none
    body: dict[str, Any] = {
        "__doc__": f"State of the registered codec hook {name!r} ({label}).",
        "__module__": getattr(factory, "__module__", __name__),
        "hook_name": name,
        "codec_factory": staticmethod(factory),
        "codec_option_names": names,
        "option_names": (*CompressedState.option_names, *names),
        **{f"default_{k}": v for k, v in defaults.items()},
    }
    if bucket_cap_mb is not None:
        body["default_bucket_cap_mb"] = bucket_cap_mb
    if advice is not None:

        def optimizer_advice(self: CompressedState, optimizer: Any) -> Optional[str]:
            return advice(self, optimizer)

        optimizer_advice.__doc__ = advice.__doc__
        body["optimizer_advice"] = optimizer_advice
    return type(f"{title}State", (CompressedState,), body)


def _check_extras(
    where: str,
    codec: Any,
    defaults: Any,
    bucket_cap_mb: Any,
    advice: Any,
) -> dict[str, Any]:
    """``defaults`` as a dict, once ``defaults``, ``bucket_cap_mb`` and ``advice`` are checked:
    each is a codec hook's (``codec=...`` without ``state=...``)."""
    given = {"defaults": defaults, "bucket_cap_mb": bucket_cap_mb, "advice": advice}
    if codec is None:
        extra = sorted(k for k, v in given.items() if v is not None)
        if extra:
            raise ValueError(
                f"{where}: {extra[0]}= without codec=...; expected it with a codec (a state "
                "class of one's own sets its defaults itself)"
            )
        return {}
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
    return out


def register_hook(
    name: str,
    state: Optional[type] = None,
    hook: Optional[Callable] = None,
    *,
    codec: Optional[Callable[..., Any]] = None,
    auto: bool = False,
    description: str = "",
    defaults: Optional[dict[str, Any]] = None,
    bucket_cap_mb: Optional[float] = None,
    advice: Optional[Callable[[Any, Any], Optional[str]]] = None,
) -> HookSpec:
    """Register a hook under ``name`` and return its :class:`HookSpec`.

    Either ``codec``, a :class:`~pycomm.hooks.Codec` class (or factory) whose keyword
    parameters, all with defaults, become the hook's options: the hook is then
    :func:`~pycomm.hooks.compressed_hook` on a generated
    :class:`~pycomm.hooks.CompressedState` subclass, and gets everything the built-in codecs
    get (two-phase exchange, error feedback, ``start_iter``, ``hierarchy``, the non-finite
    skip, stats, checkpoints). pycomm's own codecs are registered this way. Or ``state`` (a
    :class:`~pycomm.hooks.HookState` subclass) and ``hook`` (its function), with ``codec``
    optional.

    With ``codec`` alone, a hook may also give: ``defaults``, its own defaults of the engine's
    ``start_iter``, ``error_feedback`` and ``local_feedback`` (``{"start_iter": 20}``);
    ``bucket_cap_mb``, the DDP bucket size ``pycomm.wrap`` picks when the caller gives none
    (default: DDP's); ``advice``, a function ``(state, optimizer) -> str or None`` that says
    why the hook, as configured, trains worse with that optimizer (warned once, at the
    optimizer's first step: :meth:`~pycomm.hooks.HookState.optimizer_advice`).

    Raises ValueError (naming the argument, the value and what is expected) for a taken
    name, a bad spec, or a codec that breaks the protocol (the self-check of
    :func:`pycomm.hooks.check_codec`, run once on the CPU). Registering the same state and
    function again under the same name (a module imported twice) returns the spec.

    Example:
        >>> spec = pycomm.hooks.register_hook("topk", codec=TopKCodec)
        >>> pycomm.hooks.register_hook("sign", codec=SignCodec, defaults={"start_iter": 20})
        >>> pycomm.hooks.register_hook("mine", MyState, my_hook)
    """
    where = _where(name)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{where}: name={name!r}, expected lowercase letters, digits and '_', starting "
            "with a letter ('-' and ':' are the bench's variant and module:factory names)"
        )
    if codec is not None and not callable(codec):
        raise ValueError(f"{where}: codec={codec!r}, expected a Codec class or factory")
    old = _SPECS.get(name)
    # the module whose top level registers it (a second import of it registers again), not
    # the codec's: a user's module registering pycomm's Int8Codec under a name of its own
    module = _caller_module()
    if old is not None and old.module != module:
        _taken(where, old)  # before the codec's self-check: the name is the first problem
    if codec is not None:
        _check_codec_factory(where, codec)
    extras = _check_extras(where, codec if state is None else None, defaults, bucket_cap_mb, advice)
    if state is None:
        if codec is None:
            raise ValueError(f"{where}: expected codec=..., or state=... and hook=...")
        if hook is not None:
            raise ValueError(f"{where}: hook={hook!r} without state=...; expected both or neither")
        state = _codec_state(name, codec, extras, bucket_cap_mb, advice)
        hook = compressed_hook
    _check_state_and_hook(where, state, hook)
    if not isinstance(auto, bool):
        raise ValueError(f"{where}: auto={auto!r}, expected True or False")
    if not isinstance(description, str):
        raise ValueError(f"{where}: description={description!r}, expected a str (one line)")
    if auto and codec is None and name != "allreduce":
        raise ValueError(
            f"{where}: auto=True without a codec; expected codec=... (auto predicts a hook's "
            "step time from its codec's measured cost and bytes)"
        )
    if old is not None:  # the same module registering the same classes again (re-imported)
        pairs = ((old.state, state), (old.codec, codec), (old.hook, hook))
        if any(_qualname(a) != _qualname(b) for a, b in pairs):
            _taken(where, old)
    spec = HookSpec(name, state, hook, codec, auto, description, module)
    if getattr(state, "hook_name", None) == "base":  # a user's state without a name of its own
        state.hook_name = name
    _SPECS[name] = spec
    return spec


def _qualname(obj: Any) -> Optional[str]:
    return None if obj is None else getattr(obj, "__qualname__", repr(obj))


def _caller_module() -> str:
    """The module that called :func:`register_hook` (its first frame outside this module)."""
    frame = inspect.currentframe()
    try:
        while frame is not None and frame.f_globals.get("__name__") == __name__:
            frame = frame.f_back
        return "" if frame is None else str(frame.f_globals.get("__name__", ""))
    finally:
        del frame


def _check_codec_factory(where: str, codec: Callable[..., Any]) -> None:
    """The codec built at its defaults passes :func:`check_codec`, or a ValueError."""
    try:
        instance = codec()
    except TypeError as e:
        raise ValueError(
            f"{where}: codec={getattr(codec, '__name__', codec)!r} cannot be built "
            f"without arguments ({e}); expected defaults for every parameter"
        ) from e
    check_codec(instance, where)


def _check_state_and_hook(where: str, state: Any, hook: Any) -> None:
    """A HookState subclass and a function that takes (state, bucket), or a ValueError."""
    if not (isinstance(state, type) and issubclass(state, HookState)):
        raise ValueError(f"{where}: state={state!r}, expected a pycomm.hooks.HookState subclass")
    if not callable(hook):
        raise ValueError(f"{where}: hook={hook!r}, expected a function hook(state, bucket)")
    try:
        inspect.signature(hook).bind(None, None)
    except TypeError as e:
        raise ValueError(
            f"{where}: hook={getattr(hook, '__qualname__', hook)!r} cannot take (state, "
            f"bucket): {e}"
        ) from e
    except ValueError:  # a builtin without a signature: DDP will tell
        pass


def _taken(where: str, old: HookSpec) -> None:
    owner = old.state if old.codec is None else old.codec
    what = f"{getattr(owner, '__module__', '?')}.{_qualname(owner)}"
    raise ValueError(
        f"{where}: the name is taken by {'' if old.codec is None else 'codec '}{what}, "
        f"registered by module {old.module!r}; expected a new name (or unregister_hook first)"
    )


def unregister_hook(name: str) -> None:
    """Remove ``name`` from the registry (a KeyError if it is not there).

    Example:
        >>> pycomm.hooks.unregister_hook("topk")
    """
    del _SPECS[name]


def hook_spec(name: Any, where: str = "pycomm") -> HookSpec:
    """The spec of hook ``name``, or a ValueError naming it and the registered names.

    Example:
        >>> pycomm.hooks.hook_spec("int8").hook
        <function compressed_hook ...>
    """
    spec = _SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(
            f"{where}: hook={name!r} is not one of {', '.join(sorted(_SPECS))} (the registered "
            "hooks; pycomm.hooks.register_hook adds one)"
        )
    return spec


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of a class or function (``?`` where it has none)."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def registration(name: str) -> str:
    """Hook ``name``'s state class in this process, or ``not registered``: what ranks compare
    first, so that a name registered on some ranks only is named as such.

    Example:
        >>> registration("int8")
        'pycomm.hooks.codec.Int8State'
    """
    spec = _SPECS.get(name)
    return "not registered" if spec is None else qualified_name(spec.state)


def spec_identity(name: str) -> str:
    """What hook ``name`` is in this process, in one line: its state class, its function and,
    for a codec hook, its codec's class and format at the hook's defaults; ``not registered``
    when it is not. What ranks compare before using a hook by name.

    Example:
        >>> spec_identity("int8")
        'pycomm.hooks.codec.Int8State, pycomm.hooks.ddp.compressed_hook, codec ...'
    """
    spec = _SPECS.get(name)
    if spec is None:
        return "not registered"
    parts = [qualified_name(spec.state), qualified_name(spec.hook)]
    if spec.codec is not None:
        codec = codec_identity(spec.codec())
        parts.append(f"codec {codec['codec']} ({codec['codec format']})")
    return ", ".join(parts)


def hook_names(auto: Optional[bool] = None) -> list[str]:
    """The registered names in registration order; ``auto=True``: those auto may choose.

    Example:
        >>> pycomm.hooks.hook_names(auto=True)
        ['allreduce', 'bf16', 'fp16', 'int8', 'fp8', 'int4', 'onebit']
    """
    return [n for n, s in _SPECS.items() if auto is None or s.auto == auto]


def user_modules() -> list[str]:
    """The modules, outside pycomm, that registered hooks: what another process imports to
    know the same names (the bench's and quality suite's ranks do).

    Example:
        >>> user_modules()
        ['topk']
    """
    mods = {s.module for s in _SPECS.values()}
    return sorted(m for m in mods if m and not m.startswith("pycomm.") and m != "__main__")


def import_modules(modules: Any, where: str = "--import") -> None:
    """Import each of ``modules`` (names), whose top level registers hooks: what a process
    that did not run the caller's code (a bench or quality rank) does to know its hooks.
    Raises ValueError naming the module that fails.

    Example:
        >>> import_modules(["topk"])  # topk.py calls pycomm.hooks.register_hook("topk", ...)
    """
    for name in modules or ():
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
            raise ValueError(
                f"{where} {name}: cannot import module {name!r} ({type(exc).__name__}: {exc}); "
                "expected an importable module that registers hooks (run from where it "
                "imports, or set PYTHONPATH)"
            ) from exc
