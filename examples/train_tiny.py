"""FourDStrategy from Python instead of YAML: the tiny Llama on the embedded corpus, dp=2 x tp=2, ZeRO stage 1.

    python examples/train_tiny.py                 # 4 CPU processes (Lightning launches them), ~2 minutes
    python examples/train_tiny.py --zero-stage 3 --tp 1 --devices 2

On GPUs pass ``--accelerator gpu --precision bf16-mixed`` and a bigger ``--model`` (a preset name).
"""

import argparse

import lightning as L

from lightning_4d import FourDStrategy
from lightning_4d.callbacks import TrainingSummary
from lightning_4d.data import LMDataModule
from lightning_4d.models import LlamaConfig
from lightning_4d.tasks import CausalLMModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help=f"one of {LlamaConfig.preset_names()}")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        strategy=FourDStrategy(tensor_parallel_size=args.tp, zero_stage=args.zero_stage),
        max_steps=args.steps,
        val_check_interval=args.steps,
        check_val_every_n_epoch=None,
        limit_val_batches=8,
        gradient_clip_val=1.0,
        callbacks=[TrainingSummary(prompt="def ")],
        logger=False,
        enable_checkpointing=False,
    )
    model = CausalLMModule(LlamaConfig.from_preset(args.model), learning_rate=3e-3, warmup_steps=30)
    trainer.fit(model, datamodule=LMDataModule(seq_length=256, micro_batch_size=8))


if __name__ == "__main__":
    main()
