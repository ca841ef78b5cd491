"""A Hugging Face ``transformers.LlamaForCausalLM`` in your own LightningModule, split by FourDStrategy: tp + sp, cp,
pp and dp with ZeRO, from the same arguments as lightning_4d's own Llama. Trains on the embedded corpus.

    pip install -e '.[hf]'                                      # from the repository's root
    python examples/hf_llama_4d.py                              # 4 CPU processes: tp=2 x cp=2, ZeRO 1
    python examples/hf_llama_4d.py --tp 1 --cp 1 --zero-stage 3 --devices 2
    python examples/hf_llama_4d.py --pp 2 --cp 1 --devices 4      # tp=2 x pp=2, 1F1B
    # real weights on 4 GPUs, each rank reading its slices; Llama 3.2 1B ties its embedding and head, which tp and
    # pp refuse for a transformers model (FourDStrategy names the fix), so: cp=2 x dp=2, ZeRO 3
    python examples/hf_llama_4d.py --hf-dir /models/Llama-3.2-1B --tp 1 --cp 2 --zero-stage 3 --accelerator gpu

Without ``--hf-dir`` the model is a small random Llama (built in ``__init__``, the same on every rank). With it the
model is built on the meta device in ``configure_model`` and the strategy loads each rank's slices of the
safetensors files after splitting it (``init_from``): no rank holds a full copy (docs/own_module.md).
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
import transformers

from lightning_4d import FourDStrategy
from lightning_4d.contract import layout_strategy
from lightning_4d.data import LMDataModule


class HFLlamaLM(L.LightningModule):
    def __init__(self, hf_dir: str = None) -> None:
        super().__init__()
        self.init_from = hf_dir  # read by FourDStrategy after it split the model
        self.model = None
        if hf_dir is None:
            torch.manual_seed(0)
            self.model = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=256,
                    hidden_size=128,
                    intermediate_size=352,
                    num_hidden_layers=4,
                    num_attention_heads=8,
                    num_key_value_heads=4,
                    max_position_embeddings=1024,
                )
            )

    def configure_model(self) -> None:
        if self.model is None:  # real weights: an empty model on the meta device, filled by init_from
            config = transformers.AutoConfig.from_pretrained(self.init_from)
            with torch.device("meta"):
                self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        layout = layout_strategy(self.trainer.strategy)  # FourDStrategy, or None under any other strategy
        pipeline = layout.pipeline if layout is not None else None
        if pipeline is not None:  # pp > 1: the schedule runs forward + backward of all micro-batches here
            loss = pipeline.train_step(batch["input_ids"], batch["labels"])
        else:
            # our LMDataModule gives labels already shifted by one token (under cp each rank holds its shard of both)
            logits = self.model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", help="cpu (default; gloo) or gpu (nccl)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hf-dir", default=None)
    args = parser.parse_args()
    L.seed_everything(0)
    strategy = FourDStrategy(
        tensor_parallel_size=args.tp,
        context_parallel_size=args.cp,
        pipeline_parallel_size=args.pp,
        zero_stage=args.zero_stage,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
    )
    tokenizer = args.hf_dir if args.hf_dir else "byte"  # the tokenizer.json next to the weights
    trainer.fit(HFLlamaLM(args.hf_dir), LMDataModule(tokenizer=tokenizer, seq_length=128, micro_batch_size=4))


if __name__ == "__main__":
    main()
