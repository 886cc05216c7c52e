"""The one registry of pycomm's hooks: what ``pycomm.wrap(hook=name)``, ``pycomm.register``,
``hook="auto"``'s candidates, ``python -m pycomm.bench --hooks/--list-hooks`` and
``python -m pycomm.bench.quality --hooks`` read.

A hook is a :class:`HookSpec`: a name, its state class, its hook function, its codec for the
compressed hooks, and whether ``auto`` may choose it. A codec hook is a codec of the one
codec registry (:mod:`pycomm.codec.registry`): ``register_hook(name, codec=...)`` registers
it there, and every codec registered there (``pycomm.codec.register_codec``) is a hook here,
its state a generated :class:`~pycomm.hooks.CompressedState` subclass. :func:`register_hook`
checks a spec (and runs the codec once, :func:`pycomm.codec.check_codec`) when it is
registered, so a bad one is an error there, not at the first backward.

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
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pycomm.codec import registry as codecs
from pycomm.codec.registry import NAME, CodecSpec, codec_identity, qualified_name
from pycomm.hooks.ddp import CompressedState, HookState, compressed_hook

__all__ = [
    "HookSpec",
    "hook_names",
    "hook_spec",
    "register_hook",
    "registration",
    "spec_identity",
    "unregister_hook",
]


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
        <class 'pycomm.codec.codecs.Int8State'>
    """

    name: str
    state: type
    hook: Callable
    codec: Optional[Callable[[], Any]] = None
    auto: bool = False
    description: str = ""
    module: str = ""


# the hooks with a state of their own (exact, powersgd, auto, a user's); a codec's hook is
# generated from the codec registry when first asked for
_SPECS: dict[str, HookSpec] = {}
_GENERATED: dict[str, tuple[CodecSpec, HookSpec]] = {}


def _where(name: Any) -> str:
    return f"pycomm.hooks.register_hook({name!r})"


def _codec_hook(spec: CodecSpec) -> HookSpec:
    """The hook of a registered codec: :func:`~pycomm.hooks.compressed_hook` on a
    CompressedState subclass whose options are the engine's and the codec's."""
    made = _GENERATED.get(spec.name)
    if made is not None and made[0] is spec:
        return made[1]
    factory = spec.codec
    title = "".join(part.title() for part in spec.name.split("_"))
    label = getattr(factory, "__name__", None) or repr(factory)  # a functools.partial has none
    names = spec.option_names
    body: dict[str, Any] = {
        "__doc__": f"State of the registered codec hook {spec.name!r} ({label}).",
        "__module__": getattr(factory, "__module__", __name__),
        "hook_name": spec.name,
        "codec_factory": staticmethod(factory),
        "codec_option_names": names,
        "option_names": (*CompressedState.option_names, *names),
        **{f"default_{k}": v for k, v in spec.defaults.items()},
    }
    if spec.bucket_cap_mb is not None:
        body["default_bucket_cap_mb"] = spec.bucket_cap_mb
    if spec.advice is not None:
        advice = spec.advice

        def optimizer_advice(self: CompressedState, optimizer: Any) -> Optional[str]:
            return advice(self, optimizer)

        optimizer_advice.__doc__ = advice.__doc__
        body["optimizer_advice"] = optimizer_advice
    state = type(f"{title}State", (CompressedState,), body)
    hook = HookSpec(spec.name, state, compressed_hook, factory, spec.auto, spec.description,
                    spec.module)  # fmt: skip
    _GENERATED[spec.name] = (spec, hook)
    return hook


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

    Either ``codec``, a :class:`~pycomm.codec.Codec` class (or factory) whose keyword
    parameters, all with defaults, become the hook's options: the codec is registered in the
    one codec registry (:func:`pycomm.codec.register_codec`, under the same name, so
    ``pycomm.Exchange``, ``pycomm.fsdp`` and the outer loops take it too), and the hook is
    :func:`~pycomm.hooks.compressed_hook` on a generated
    :class:`~pycomm.hooks.CompressedState` subclass: it gets everything the built-in codecs
    get (two-phase exchange, error feedback, ``start_iter``, ``hierarchy``, the non-finite
    skip, stats, checkpoints). Or ``state`` (a :class:`~pycomm.hooks.HookState` subclass) and
    ``hook`` (its function), with ``codec`` optional (auto times it).

    With ``codec`` alone, a hook may also give: ``defaults``, its own defaults of the engine's
    ``start_iter``, ``error_feedback`` and ``local_feedback`` (``{"start_iter": 20}``);
    ``bucket_cap_mb``, the DDP bucket size ``pycomm.wrap`` picks when the caller gives none
    (default: DDP's); ``advice``, a function ``(state, optimizer) -> str or None`` that says
    why the hook, as configured, trains worse with that optimizer (warned once, at the
    optimizer's first step: :meth:`~pycomm.hooks.HookState.optimizer_advice`).

    Raises ValueError (naming the argument, the value and what is expected) for a taken
    name, a bad spec, or a codec that breaks the protocol (the self-check of
    :func:`pycomm.codec.check_codec`, run once on the CPU). Registering the same state and
    function again under the same name (a module imported twice) returns the spec.

    Example:
        >>> spec = pycomm.hooks.register_hook("topk", codec=TopKCodec)
        >>> pycomm.hooks.register_hook("sign", codec=SignCodec, defaults={"start_iter": 20})
        >>> pycomm.hooks.register_hook("mine", MyState, my_hook)
    """
    where = _where(name)
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(
            f"{where}: name={name!r}, expected lowercase letters, digits and '_', starting "
            "with a letter ('-' and ':' are the bench's variant and module:factory names)"
        )
    if codec is not None and not callable(codec):
        raise ValueError(f"{where}: codec={codec!r}, expected a Codec class or factory")
    module = codecs.caller_module(__name__)
    old = _SPECS.get(name)
    if old is not None and old.module != module:
        _taken(where, old)  # before the codec's self-check: the name is the first problem
    if state is None:
        if codec is None:
            raise ValueError(f"{where}: expected codec=..., or state=... and hook=...")
        if hook is not None:
            raise ValueError(f"{where}: hook={hook!r} without state=...; expected both or neither")
        codecs.register_codec(name, codec, auto=auto, description=description,
                              defaults=defaults, bucket_cap_mb=bucket_cap_mb, advice=advice,
                              module=module, where=where)  # fmt: skip
        return hook_spec(name)
    given = {"defaults": defaults, "bucket_cap_mb": bucket_cap_mb, "advice": advice}
    extra = sorted(k for k, v in given.items() if v is not None)
    if extra:
        raise ValueError(
            f"{where}: {extra[0]}= without codec=...; expected it with a codec (a state class "
            "of one's own sets its defaults itself)"
        )
    taken = codecs.find_codec(name)
    if taken is not None and taken.module != module:
        codecs.taken(where, name, taken.codec, taken.module)
    if codec is not None:
        codecs.check_codec(_built(where, codec), where)
    _check_state_and_hook(where, state, hook)  # (the codec registered last, once all is checked)
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
    if codec is not None:  # the Exchange, FSDP2 and the outer loops take it under the name
        codecs.register_codec(name, codec, description=description, module=module, where=where)
    _SPECS[name] = spec
    codecs.reserve(name, state, module)  # no other codec of that name: one name, one meaning
    return spec


def _built(where: str, codec: Callable[..., Any]) -> Any:
    try:
        return codec()
    except TypeError as e:
        raise ValueError(
            f"{where}: codec={getattr(codec, '__name__', codec)!r} cannot be built "
            f"without arguments ({e}); expected defaults for every parameter"
        ) from e


def _qualname(obj: Any) -> Optional[str]:
    return None if obj is None else getattr(obj, "__qualname__", repr(obj))


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
    codecs.taken(where, old.name, owner, old.module, codec=old.codec is not None)


def unregister_hook(name: str) -> None:
    """Remove ``name`` from the registry, and a codec of that name from the codec registry
    (a KeyError if it is in neither).

    Example:
        >>> pycomm.hooks.unregister_hook("topk")
    """
    found = _SPECS.pop(name, None) is not None
    codecs.release(name)
    if codecs.find_codec(name) is not None:
        codecs.unregister_codec(name)
        found = True
    if not found:
        raise KeyError(name)


def _find(name: Any) -> Optional[HookSpec]:
    if not isinstance(name, str):
        return None
    spec = _SPECS.get(name)
    if spec is not None:
        return spec
    codec = codecs.find_codec(name)
    return None if codec is None else _codec_hook(codec)


def hook_spec(name: Any, where: str = "pycomm") -> HookSpec:
    """The spec of hook ``name``, or a ValueError naming it and the registered names.

    Example:
        >>> pycomm.hooks.hook_spec("int8").hook
        <function compressed_hook ...>
    """
    spec = _find(name)
    if spec is None:
        raise ValueError(
            f"{where}: hook={name!r} is not one of {', '.join(sorted(hook_names()))} (the "
            "registered hooks; pycomm.hooks.register_hook adds one)"
        )
    return spec


def registration(name: str) -> str:
    """Hook ``name``'s state class in this process, or ``not registered``: what ranks compare
    first, so that a name registered on some ranks only is named as such.

    Example:
        >>> registration("int8")
        'pycomm.codec.codecs.Int8State'
    """
    spec = _find(name)
    return "not registered" if spec is None else qualified_name(spec.state)


def spec_identity(name: str) -> str:
    """What hook ``name`` is in this process, in one line: its state class, its function and,
    for a codec hook, its codec's class and format at the hook's defaults; ``not registered``
    when it is not. What ranks compare before using a hook by name.

    Example:
        >>> spec_identity("int8")
        'pycomm.codec.codecs.Int8State, pycomm.hooks.ddp.compressed_hook, codec ...'
    """
    spec = _find(name)
    if spec is None:
        return "not registered"
    parts = [qualified_name(spec.state), qualified_name(spec.hook)]
    if spec.codec is not None:
        codec = codec_identity(spec.codec())
        parts.append(f"codec {codec['codec']} ({codec['codec format']})")
    return ", ".join(parts)


def hook_names(auto: Optional[bool] = None) -> list[str]:
    """The registered names: the exact hooks auto may choose first, then the codecs in
    registration order, then the other hooks; ``auto=True``: those auto may choose (the most
    exact first).

    Example:
        >>> pycomm.hooks.hook_names(auto=True)
        ['allreduce', 'bf16', 'fp16', 'int8', 'fp8', 'int4', 'onebit']
    """
    exact = [n for n, s in _SPECS.items() if s.auto and s.codec is None]
    names = exact + [n for n in codecs.codec_names() if n not in _SPECS]
    names += [n for n in _SPECS if n not in names]
    return [n for n in names if auto is None or _find(n).auto == auto]


def user_modules() -> list[str]:
    """The modules, outside pycomm, that registered hooks or codecs: what another process
    imports to know the same names (the bench's and quality suite's ranks do).

    Example:
        >>> user_modules()
        ['topk']
    """
    mods = {s.module for s in _SPECS.values()}
    mods |= {codecs.codec_spec(n).module for n in codecs.codec_names()}
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
