"""Below autograd: the dispatch mode that sees every ATen op, tensor wrapper subclasses, and pytree flattening."""

from typing import Any

#: ``TorchDispatchMode``: the base of a mode that sees every ATen op below autograd (``torch.utils._python_dispatch``;
#: the communication meter, ``parallel/comm.py``); ``untracked()``: a context in which no such mode sees the ops
#: (``_disable_current_modes``: the activation offload's host copies, ``parallel/offload.py``, are not device memory
#: for ``LiveTensorBytes``); ``is_traceable_wrapper_subclass(t)``: ``t`` is a tensor subclass wrapping inner tensors
#: (DTensor, float8, ...) that ``t.__tensor_flatten__()`` names (``lightning_4d.measure`` counts their storages)
from torch.utils._python_dispatch import (  # noqa: F401  (re-exported)
    TorchDispatchMode,
    _disable_current_modes as untracked,
    is_traceable_wrapper_subclass,
)

#: ``tree_flatten(obj) -> (leaves, spec)`` of nested lists / tuples / dicts (``torch.utils._pytree``)
from torch.utils._pytree import tree_flatten  # noqa: F401  (re-exported)


def inner_tensors(t: Any) -> list[Any]:
    """The inner tensors of a traceable wrapper subclass ``t`` (:func:`is_traceable_wrapper_subclass`: DTensor,
    float8, ...), the attributes its ``t.__tensor_flatten__()`` names, in that order (a name's value may be ``None``
    or a non-tensor for some subclasses: the callers filter)."""
    names, _ = t.__tensor_flatten__()
    return [getattr(t, name) for name in names]  # the subclass's own attribute names: read by name
