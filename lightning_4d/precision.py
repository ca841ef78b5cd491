"""The precision plugin ``FourDStrategy`` runs with: the Trainer's own plugin (``32-true``, ``bf16-mixed``, ...) plus
the two things of an optimizer step that our layouts change, as Lightning overrides rather than patches:

- the step of an optimizer wrapped by a :class:`~lightning_4d.parallel.sharded_optimizer.ShardedOptimizer` (ZeRO 1,
  master weights) is that ``ShardedOptimizer``'s, not ``optimizer.step`` (:meth:`FourDPrecision.optimizer_step`);
- the Trainer's ``gradient_clip_val`` clips by the global norm over all shards and pipeline stages
  (:meth:`FourDPrecision.clip_grad_by_norm`: :func:`lightning_4d.parallel.clipping.clip_grad_norm_`,
  :meth:`FourDPrecision.clip_grad_by_value`).

Lightning's call path is ``Strategy.optimizer_step -> precision_plugin.optimizer_step`` and ``LightningModule
.clip_gradients -> trainer.precision_plugin.clip_gradients -> clip_grad_by_norm / clip_grad_by_value``; the Trainer's
plugin class depends on the precision flag, so :func:`four_d_precision` derives a subclass of whichever class it is
(``FourDPrecision`` first in the method order), as Lightning's ``LightningOptimizer`` derives one of the optimizer's
class, and the strategy installs it through its ``precision_plugin`` setter.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

from lightning_4d.features.moe import runtime as moe
from lightning_4d.parallel.clipping import clip_grad_norm_
from lightning_4d.parallel.sharded_optimizer import ShardedOptimizer, unwrap_optimizer

_NORM = GradClipAlgorithmType.NORM


def loss_scaler(plugin: Precision) -> Optional[Any]:
    """The float16 gradient scaler (``torch.amp.GradScaler``) of a Lightning precision plugin: ``MixedPrecision``'s
    and ``FSDPPrecision``'s under ``16-mixed``; ``None`` under ``bf16-mixed`` or for a plugin that scales nothing."""
    return plugin.scaler if isinstance(plugin, (MixedPrecision, FSDPPrecision)) else None


class FourDPrecision(Precision):
    """Placed before the Trainer's precision plugin class (:func:`four_d_precision`); every other method is that
    class's.

    Attributes:
        pp_group: the pipeline's process group (pp > 1), over which :meth:`clip_grad_by_norm` makes the norm
            global (each stage holds other parameters), or ``None``.
        norm_excluded: returns the parameters the global norm leaves out (see the attribute's comment).
    """

    pp_group: Optional[dist.ProcessGroup] = None
    #: a callable returning the parameters whose gradients the global norm leaves out (scaled all the same): the LM
    #: head's copy of tied embeddings under pp
    #: (:meth:`lightning_4d.features.pipeline.runtime.TiedEmbedding.norm_excluded`)
    norm_excluded: Callable[[], list[Any]] = staticmethod(list)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """An optimizer with a :class:`~lightning_4d.parallel.sharded_optimizer.ShardedOptimizer` steps through it
        (:meth:`ShardedOptimizer.step <lightning_4d.parallel.sharded_optimizer.ShardedOptimizer.step>`: the closure,
        then the owned slices, then the all-gather), with the closure of Lightning's ``Precision.optimizer_step``
        (forward, backward, ``on_before_optimizer_step``, clipping); any other optimizer as the Trainer's plugin
        steps it."""
        sharded = ShardedOptimizer.of(unwrap_optimizer(optimizer))
        if sharded is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        return sharded.step(closure=partial(self._wrap_closure, model, optimizer, closure), **kwargs)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the global norm with the one :func:`~lightning_4d.parallel.clipping.clip_grad_norm_` wherever
        Lightning's own clipping would not see the whole gradient: the averaged gradients in a ``ShardedOptimizer``'s
        buckets, a pipeline (Lightning's would clip each stage by its own norm), gradients on meshes torch's own norm
        cannot stack (:func:`lightning_4d.features.moe.runtime.on_own_mesh`, ZeRO 2/3 under ep); else Lightning's own
        clipping (torch's ``clip_grad_norm_``: one mesh, no stages)."""
        sharded = ShardedOptimizer.of(unwrap_optimizer(optimizer))
        params = list(self.main_params(optimizer))
        if sharded is not None or self.pp_group is not None or moe.on_own_mesh(params):
            clip_grad_norm_(
                params, float(clip_val), pp_group=self.pp_group, sharded=sharded, exclude=self.norm_excluded()
            )
        else:
            super().clip_grad_by_norm(optimizer, clip_val)

    def clip_gradients(
        self, optimizer: Any, clip_val: Union[int, float] = 0.0, gradient_clip_algorithm: Any = _NORM
    ) -> None:
        """Lightning's clipping, but where nothing is loss-scaled (no float16 gradient scaler: ``bf16-mixed``,
        ``32-true``) also for a fused optimizer (``torch.optim.AdamW(fused=True)``, ``CausalLMModule``'s), which
        Lightning's AMP plugin refuses because a fused optimizer would unscale float16 gradients itself."""
        if loss_scaler(self) is None:
            return Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        """Clamp the averaged gradients in a ``ShardedOptimizer``'s buckets, else Lightning's own clipping."""
        sharded = ShardedOptimizer.of(unwrap_optimizer(optimizer))
        if sharded is not None:
            sharded.clip_grad_value_(float(clip_val))
        else:
            super().clip_grad_by_value(optimizer, clip_val)


@lru_cache(maxsize=None)
def _four_d_class(base: type) -> type:
    """``FourD<base>``: ``FourDPrecision`` first in the method order, then ``base`` (the Trainer's plugin class).

    Built at run time because nothing simpler keeps the Trainer's plugin what it is: the plugin's class is chosen
    by the Trainer from the precision flag, and may be any subclass of ``Precision`` (Lightning's ``MixedPrecision``,
    ``HalfPrecision``, ``DoublePrecision``, ``TransformerEnginePrecision``, ``BitsandbytesPrecision``, or a user's own
    passed through ``plugins=``); Lightning and this package test it with ``isinstance`` (``MixedPrecision`` decides
    whether a fused optimizer may be clipped, ``CausalLMModule.uses_fused_adamw``), and its methods read its own state
    (``scaler``, ``precision``, ...). A class written out per Lightning plugin misses a user's plugin; a wrapper
    holding the plugin fails those ``isinstance`` tests and must forward every attribute; setting our methods on the
    instance patches the plugin. One cached subclass per plugin class (``lru_cache``) is the way Lightning's own
    ``LightningOptimizer`` wraps the optimizer's class.
    """
    return type(f"FourD{base.__name__}", (FourDPrecision, base), {})


def four_d_precision(plugin: Precision, pp_group: Optional[dist.ProcessGroup]) -> FourDPrecision:
    """``plugin`` as an instance of ``FourDPrecision`` + ``plugin``'s class, sharing ``plugin``'s state (its
    ``__dict__``), with ``pp_group`` (see :class:`FourDPrecision`); ``plugin`` itself, given the new ``pp_group``, when
    it is one already (a second ``setup``)."""
    if not isinstance(plugin, FourDPrecision):
        wrapped = _four_d_class(type(plugin)).__new__(_four_d_class(type(plugin)))
        wrapped.__dict__ = plugin.__dict__  # one state, as LightningOptimizer shares its optimizer's
        plugin = wrapped
    plugin.pp_group = pp_group
    return plugin
