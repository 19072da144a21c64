"""Plain record classes: the part of @dataclass this package uses, without its cost.

Importing `dataclasses` imports `inspect` (with `dis`, `ast`, ...: ~20 ms), and each
@dataclass compiles its methods at import (~0.5 ms a class). The CLI pays both on
every start, for a process that lives a few milliseconds. A record reads the same
class body (annotations, defaults, `field(...)`) and shares generic methods.

    @record                      # or @record(frozen=True)
    class Point:
        x: int
        y: int = 0
        tags: list[str] = field(default_factory=list)

asdict(), replace() and fields() work as their dataclasses namesakes do.
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` costs ~5 ms to import: annotations here are strings
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    T = TypeVar("T")

_MISSING = object()


class FrozenInstanceError(AttributeError):
    """Assignment to a field of a frozen record."""


class Field:
    """A field's name and what its default is; `repr`/`compare` as in dataclasses."""

    __slots__ = ("name", "default", "default_factory", "repr", "compare")

    def __init__(self, default: Any = _MISSING, default_factory: Callable[[], Any] | None = None,
                 repr: bool = True, compare: bool = True) -> None:  # noqa: A002 - dataclasses' name
        self.name = ""
        self.default, self.default_factory, self.repr, self.compare = default, default_factory, repr, compare

    def __repr__(self) -> str:
        return f"Field({self.name!r})"


def field(*, default: Any = _MISSING, default_factory: Callable[[], Any] | None = None, repr: bool = True,  # noqa: A002
          compare: bool = True) -> Any:
    return Field(default, default_factory, repr, compare)


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    cls = type(self)
    specs: tuple[Field, ...] = cls.__record_fields__
    if len(args) > len(specs):
        raise TypeError(f"{cls.__name__}() takes {len(specs)} positional arguments but {len(args)} were given")
    setter = object.__setattr__
    for i, f in enumerate(specs):
        if i < len(args):
            if f.name in kwargs:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {f.name!r}")
            value = args[i]
        elif f.name in kwargs:
            value = kwargs[f.name]
        elif f.default_factory is not None:
            value = f.default_factory()
        elif f.default is not _MISSING:
            value = f.default
        else:
            raise TypeError(f"{cls.__name__}() missing required argument: {f.name!r}")
        setter(self, f.name, value)
    if kwargs and not cls.__record_names__.issuperset(kwargs):
        unknown = sorted(set(kwargs) - cls.__record_names__)
        raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {unknown[0]!r}")
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


def _repr(self: Any) -> str:
    inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self.__record_fields__ if f.repr)
    return f"{type(self).__qualname__}({inner})"


def _key(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, f.name) for f in self.__record_fields__ if f.compare)


def _eq(self: Any, other: object) -> bool:
    if other is self:
        return True
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _key(self) == _key(other)


def _hash(self: Any) -> int:
    # Frozen: computed once (records used as cache keys are hashed on every run).
    h = self.__dict__.get("_record_hash")
    if h is None:
        h = hash(_key(self))
        object.__setattr__(self, "_record_hash", h)
    return h  # type: ignore[no-any-return]


def _getstate(self: Any) -> dict[str, Any]:
    state = dict(self.__dict__)
    state.pop("_record_hash", None)  # string hashes differ from process to process
    return state


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _make(cls: type[T], frozen: bool) -> type[T]:
    specs: dict[str, Field] = {}
    for base in reversed(cls.__mro__[1:]):  # a record's fields follow those of the records it extends
        for f in getattr(base, "__record_fields__", ()):
            specs[f.name] = f
    for name, ann in cls.__dict__.get("__annotations__", {}).items():
        if isinstance(ann, str) and ann.startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = cls.__dict__.get(name, _MISSING)
        f = value if isinstance(value, Field) else Field(default=value)
        f.name = name
        if isinstance(value, Field):
            if f.default is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
        specs[name] = f
    cls.__record_fields__ = tuple(specs.values())  # type: ignore[attr-defined]
    cls.__record_names__ = frozenset(specs)  # type: ignore[attr-defined]
    cls.__init__ = _init  # type: ignore[misc]
    if "__repr__" not in cls.__dict__:
        cls.__repr__ = _repr  # type: ignore[assignment]
    cls.__eq__ = _eq  # type: ignore[assignment]
    if frozen:
        cls.__hash__ = _hash  # type: ignore[assignment]
        cls.__setattr__ = _frozen_setattr  # type: ignore[assignment]
        cls.__delattr__ = _frozen_delattr  # type: ignore[assignment]
        cls.__getstate__ = _getstate  # type: ignore[attr-defined]
    else:
        cls.__hash__ = None  # type: ignore[assignment]  # mutable and compared by value: unhashable
    return cls


def record(cls: type[T] | None = None, /, *, frozen: bool = False) -> Any:
    if cls is None:
        return lambda c: _make(c, frozen)
    return _make(cls, frozen)


def is_record(obj: object) -> bool:
    return hasattr(type(obj) if not isinstance(obj, type) else obj, "__record_fields__")


def fields(obj: object) -> tuple[Field, ...]:
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__record_fields__  # type: ignore[attr-defined,no-any-return]


def _plain(value: Any) -> Any:
    if hasattr(type(value), "__record_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in type(value).__record_fields__}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return type(value)((_plain(k), _plain(v)) for k, v in value.items())
    return value  # str, bytes, numbers, None: immutable; other objects are shared, not copied


def asdict(obj: Any) -> dict[str, Any]:
    """The record as nested dicts (records), lists, tuples and dicts, recursively."""
    return _plain(obj)  # type: ignore[no-any-return]


def replace(obj: T, **changes: Any) -> T:
    """A copy of `obj` with some fields changed."""
    cls = type(obj)
    for name in changes:
        if name not in cls.__record_names__:  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")
    values = {f.name: getattr(obj, f.name) for f in cls.__record_fields__}  # type: ignore[attr-defined]
    values.update(changes)
    return cls(**values)
