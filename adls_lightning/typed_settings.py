"""Configured values checked against the Python types their objects declare, before anything is built.

The schema of a setting is the annotation of the argument it is passed to: a callback's constructor's type hints
(``gptq: GPTQConfig | None``), a dataclass's fields, a ``TypedDict``'s keys (a section such as
``prune.schedule``), a quantizer's constructor (``quant.config.default.weight.params``). :func:`check_call` walks a
configured node against them, so a value of the wrong type is one line naming its full key and the valid type
(``quant.gptq.batches='many': must be an integer``) instead of a ``TypeError`` from deep inside the constructor.
Ranges and relations between values stay the objects' own checks.

Rules, for values as YAML and the command line give them (plain containers):

* ``int`` is an integer, never a boolean; ``float`` also takes an integer; ``bool`` only ``true``/``false``.
* A section (a mapping, a dataclass or a ``TypedDict``) declared ``X | None`` takes ``false`` as ``null``: off
  (:func:`section` is the constructors' half of that rule). Its keys are checked one by one; an unknown key is
  refused naming it.
* A mapping with a ``_target_`` is the object it builds: its arguments are checked against that callable.
* ``Annotated[T, check]`` runs ``check(key, value)`` after ``T`` (a check no type says, e.g. inductor options).
* A class may add checks of a mapping of its fields with a ``check_settings(key, mapping)`` class method (a
  quantizer's parameters depend on the ``format`` next to them).
* ``Any``, an unresolvable annotation and Hydra's ``???`` (a value a sweep fills in) are not checked.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from adls_lightning.errors import ConfigError

#: Hydra's mark of a value that is still missing (a search fills it in per trial).
MISSING = "???"


def section(value: Any, key: str) -> dict[str, Any] | None:
    """A section setting as its constructor reads it: ``None`` for ``null`` or ``false`` (off), else a plain dict.

    Raises:
        ConfigError: anything else (``key=3: must be a mapping, or null/false for none``).
    """
    if value is None or value is False:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}={value!r}: must be a mapping, or null/false for none")
    return dict(value)


def type_hints(obj: Any) -> dict[str, Any]:
    """The evaluated annotations of a callable's parameters (a class: its ``__init__``'s), ``{}`` when they cannot
    be evaluated."""
    function = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception:  # an annotation naming something not importable here: nothing to check against
        return {}


def check_call(key: str, obj: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Check the keyword arguments a config passes to ``obj`` (a class or function) against its type hints.

    Keys starting with ``_`` (Hydra's ``_target_``, ``_convert_``...) are Hydra's, not arguments.

    Raises:
        ConfigError: an argument ``obj`` does not take, or a value of the wrong type, named ``key.<argument>``.
    """
    from adls_lightning.build import check_argument_names

    named = check_argument_names(key, obj, kwargs)
    if named is None:
        return
    hints = type_hints(obj)
    for name, value in kwargs.items():
        if name in named and name in hints:
            check_value(_join(key, name), value, hints[name])


def check_value(key: str, value: Any, annotation: Any) -> None:
    """Check one configured value against a type annotation.

    Raises:
        ConfigError: ``key=value: must be <the valid type>`` (or a nested key's own line).
    """
    if isinstance(value, str) and value == MISSING:
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        check_value(key, value, args[0])
        for extra in annotation.__metadata__:
            if callable(extra):
                extra(key, value)
        return
    if isinstance(value, Mapping) and "_target_" in value:
        _check_target(key, value)  # the object it builds says what it takes, whatever else the slot allows
        return
    if origin in (typing.Union, types.UnionType):
        _check_union(key, value, args)
        return
    if not _shape_fits(value, annotation):
        raise ConfigError(f"{key}={value!r}: must be {describe(annotation)}")
    _check_inside(key, value, annotation)


def _check_union(key: str, value: Any, members: tuple[Any, ...]) -> None:
    if value is False and type(None) in members and any(_is_section(m) for m in members):
        return  # false = off, as null (section())
    fitting = [m for m in members if _shape_fits(value, m)]
    first_error: ConfigError | None = None
    for member in fitting:
        try:
            check_value(key, value, member)
            return
        except ConfigError as err:
            first_error = first_error or err
    if first_error is not None:  # the value has a valid shape, but something inside it is wrong: that line
        raise first_error
    raise ConfigError(f"{key}={value!r}: must be {_describe_union(members)}")


def _strip(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _is_section(annotation: Any) -> bool:
    annotation = _strip(annotation)
    origin = typing.get_origin(annotation) or annotation
    return (
        (inspect.isclass(origin) and issubclass(origin, collections.abc.Mapping))
        or dataclasses.is_dataclass(annotation)
        or typing.is_typeddict(annotation)
    )


def _is_sequence(origin: Any) -> bool:
    return inspect.isclass(origin) and (
        issubclass(origin, (list, tuple))
        or origin in (collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection)
    )


def _shape_fits(value: Any, annotation: Any) -> bool:
    """Whether ``value``'s outer type fits ``annotation`` (what is inside is checked by :func:`_check_inside`)."""
    annotation = _strip(annotation)
    if annotation is Any or isinstance(annotation, (str, typing.ForwardRef, typing.TypeVar)):
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_shape_fits(value, m) for m in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is None or annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if typing.is_typeddict(annotation):
        return isinstance(value, Mapping)
    if dataclasses.is_dataclass(annotation) and inspect.isclass(annotation):
        return isinstance(value, (annotation, Mapping))
    if origin is collections.abc.Callable or annotation is collections.abc.Callable:
        return callable(value) and not isinstance(value, str)
    container = origin or annotation
    if _is_sequence(container):
        return isinstance(value, (list, tuple))
    if inspect.isclass(container) and issubclass(container, collections.abc.Mapping):
        return isinstance(value, Mapping)
    if inspect.isclass(container):
        return isinstance(value, container) or (isinstance(value, Mapping) and "_target_" in value)
    return True  # a typing construct not handled here: not checked


def _check_inside(key: str, value: Any, annotation: Any) -> None:
    annotation = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(value, Mapping) and "_target_" in value:
        _check_target(key, value)
        return
    if typing.is_typeddict(annotation):
        _check_fields(key, value, typing.get_type_hints(annotation, include_extras=True), annotation)
        return
    if dataclasses.is_dataclass(annotation) and isinstance(value, Mapping):
        _check_dataclass(key, value, annotation)
        return
    if _is_sequence(origin) and args:
        element = args[0] if origin is not tuple or len(args) == 2 and args[1] is Ellipsis else None
        for index, item in enumerate(value):
            member = element if element is not None else (args[index] if index < len(args) else Any)
            check_value(f"{key}[{index}]", item, member)
        return
    if inspect.isclass(origin) and issubclass(origin, collections.abc.Mapping) and len(args) == 2:
        for name, item in value.items():
            check_value(_join(key, name), item, args[1])


def _check_fields(key: str, value: Mapping, fields: Mapping[str, Any], owner: Any) -> None:
    view = getattr(owner, "settings_view", None)
    if callable(view):  # the mapping as the class reads it (a recipe's dotted layer names)
        value = view(value)
    for name, item in value.items():
        if str(name).startswith("_"):
            continue
        if name not in fields:
            raise ConfigError(f"{_join(key, name)}: unknown key; valid: {', '.join(fields)}")
        check_value(_join(key, name), item, fields[name])
    extra = getattr(owner, "check_settings", None)
    if callable(extra):
        extra(key, value)


def _check_target(key: str, value: Mapping) -> None:
    """A mapping that builds an object: its arguments against the callable its ``_target_`` names (when that can
    be imported: whether it may be built at all is :mod:`adls_lightning.build`'s check)."""
    from adls_lightning.build import resolve_target

    target = value.get("_target_")
    obj = resolve_target(target) if isinstance(target, str) and "${" not in target else None
    if obj is None:
        return
    if dataclasses.is_dataclass(obj) and inspect.isclass(obj):
        _check_dataclass(key, value, obj)
        return
    check_call(key, obj, value)
    extra = getattr(obj, "check_settings", None) if inspect.isclass(obj) else None
    if callable(extra):
        extra(key, {k: v for k, v in value.items() if not str(k).startswith("_")})


def _check_dataclass(key: str, value: Mapping, cls: type) -> None:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}
    _check_fields(key, value, fields, cls)


def _join(key: str, name: Any) -> str:
    return f"{key}.{name}" if key else str(name)


def describe(annotation: Any) -> str:
    """The valid values of an annotation in words (``an integer``, ``a list of strings``, ``a mapping or null``)."""
    annotation = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _describe_union(args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    simple = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
        None: "null",
    }
    if annotation in simple:
        return simple[annotation]
    if typing.is_typeddict(annotation):
        return "a mapping {" + ", ".join(typing.get_type_hints(annotation)) + "}"
    if dataclasses.is_dataclass(annotation) and inspect.isclass(annotation):
        return "a mapping {" + ", ".join(f.name for f in dataclasses.fields(annotation) if f.init) + "}"
    if origin is collections.abc.Callable or annotation is collections.abc.Callable:
        return "a callable"
    container = origin or annotation
    if _is_sequence(container):
        inner = describe(args[0]) if args and args[0] is not Any else ""
        if " or " in inner or ", " in inner:
            return f"a list of ({inner})"
        return "a list" + (f" of {_plural(inner)}" if inner else "")
    if inspect.isclass(container) and issubclass(container, collections.abc.Mapping):
        return "a mapping"
    if inspect.isclass(container):
        return f"a {container.__name__}"
    return str(annotation)


def _describe_union(members: tuple[Any, ...]) -> str:
    words = list(dict.fromkeys(describe(m) for m in members if m is not type(None)))
    if type(None) in members:
        section_like = any(_is_section(m) for m in members)
        words.append("null/false (off)" if section_like else "null")
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def _plural(words: str) -> str:
    for article in ("an ", "a "):
        if words.startswith(article):
            return words[len(article) :] + "s"
    return words
