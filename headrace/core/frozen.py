"""A quicker ``__init__`` for the frozen dataclasses built for every trajectory.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (its
own ``__setattr__`` refuses), several times the cost of a plain attribute (benchmarks/RESULTS.md,
"Real-model speed", item 5), and the engine builds several such objects per trajectory
(``SampledTokens``, ``StepResult``, ``Transition``, ``Trajectory``, ``Datum``...).
``quick_init`` replaces that ``__init__`` with one that fills the instance's ``__dict__``
directly: the same parameters, defaults, default factories and ``__post_init__`` call, and the
class stays frozen (assignment still raises ``FrozenInstanceError``). Fields with ``init=False``,
``InitVar`` or ``kw_only`` are refused at import time (none of these types has one), as is a
class with ``__slots__`` (no ``__dict__`` to fill).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

C = TypeVar("C")

_FACTORY: Any = type("_Factory", (), {"__repr__": lambda self: "<factory>"})()  # "use the default factory"


def quick_init(cls: type[C]) -> type[C]:
    """Give the frozen dataclass ``cls`` an ``__init__`` that writes its ``__dict__`` directly."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" in cls.__dict__:
        raise TypeError(f"quick_init is for frozen dataclasses with a __dict__; {cls.__name__} is not one")
    names: dict[str, Any] = {"_FACTORY": _FACTORY}
    args, body = [], ["d = self.__dict__"]
    if any(isinstance(v, dataclasses.InitVar) for v in getattr(cls, "__annotations__", {}).values()):
        raise TypeError(f"quick_init does not handle the InitVar fields of {cls.__name__}")
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # (fields() holds no InitVar or ClassVar)
        if not f.init or f.kw_only:
            raise TypeError(f"quick_init does not handle the field {cls.__name__}.{f.name}")
        if f.default is not dataclasses.MISSING:
            names[f"_d_{f.name}"] = f.default
            args.append(f"{f.name}=_d_{f.name}")
            body.append(f"d[{f.name!r}] = {f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"_f_{f.name}"] = f.default_factory
            args.append(f"{f.name}=_FACTORY")
            body.append(f"d[{f.name!r}] = _f_{f.name}() if {f.name} is _FACTORY else {f.name}")
        else:
            args.append(f.name)
            body.append(f"d[{f.name!r}] = {f.name}")
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    source = f"def __init__(self, {', '.join(args)}):\n" + "\n".join(f"    {line}" for line in body)
    exec(source, names)  # noqa: S102 - generated from the class's own field names, as dataclasses does
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
