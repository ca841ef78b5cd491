"""Bad input gets a ValueError naming the value and what would be valid, before any process group exists."""

import pytest
import torch.distributed as dist

from lightning_4d import FourDStrategy, ParallelConfig
from lightning_4d.models import LlamaConfig


def test_world_size_must_be_product_of_sizes():
    config = ParallelConfig(data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"world size 8 != pp\*dp\*cp\*tp = 1\*2\*1\*2 = 4"):
        config.resolve(8)
    assert config.resolve(4).world_size == 4


def test_auto_dp_fills_the_world():
    config = ParallelConfig(tensor_parallel_size=2).resolve(8)
    assert (config.pp, config.dp, config.cp, config.tp) == (1, 4, 1, 2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pp\*cp\*tp = 1\*1\*4 = 4"):
        ParallelConfig(tensor_parallel_size=4).resolve(6)


@pytest.mark.parametrize("stage", [-1, 4, 1.5, True, "1"])
def test_zero_stage_outside_0_3(stage):
    with pytest.raises(ValueError, match=r"zero_stage=.* expected one of \[0, 1, 2, 3\]"):
        ParallelConfig(zero_stage=stage)
    with pytest.raises(ValueError, match="zero_stage"):
        FourDStrategy(zero_stage=stage)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"])
def test_sizes_must_be_positive_ints(name):
    with pytest.raises(ValueError, match=f"{name}=0 is not valid"):
        ParallelConfig(**{name: 0})


def test_unknown_activation_checkpointing():
    with pytest.raises(ValueError, match=r"activation_checkpointing='some' .*\['none', 'full', 'selective'\]"):
        ParallelConfig(activation_checkpointing="some")
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        FourDStrategy(activation_checkpointing="some")


def test_selective_activation_checkpointing_is_accepted():
    assert ParallelConfig(activation_checkpointing="selective").activation_checkpointing == "selective"
    strategy = FourDStrategy(tensor_parallel_size=2, pipeline_parallel_size=2, activation_checkpointing="selective")
    assert strategy.parallel_config.activation_checkpointing == "selective"


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_selective_checkpointing_refuses_the_zero_bubble_schedules(schedule):
    """Their split backward recomputes each layer twice (input, then weight gradients); PyTorch's selective
    checkpointing hands its saved outputs out once (measured: "Trying to backward an extra time")."""
    with pytest.raises(
        ValueError,
        match=rf"activation_checkpointing='selective' does not work with pipeline_schedule="
        rf"'{schedule}'.*'full'.*\['gpipe', '1f1b', 'interleaved_1f1b'\]",
    ):
        ParallelConfig(pipeline_parallel_size=2, pipeline_schedule=schedule, activation_checkpointing="selective")
    ParallelConfig(pipeline_parallel_size=2, pipeline_schedule=schedule, activation_checkpointing="full")
    ParallelConfig(pipeline_schedule=schedule, activation_checkpointing="selective")  # pp = 1: no pipeline


def test_heads_not_divisible_by_tp():
    model = LlamaConfig(hidden_size=96, num_heads=6, num_kv_heads=6, intermediate_size=192)
    with pytest.raises(
        ValueError, match=r"num_heads=6 is not divisible by tensor_parallel_size=4; valid .*\[1, 2, 3, 6\]"
    ):
        ParallelConfig(tensor_parallel_size=4).resolve(4).validate_model(model)


def test_kv_heads_not_divisible_by_tp():
    model = LlamaConfig(hidden_size=128, num_heads=8, num_kv_heads=2, intermediate_size=256)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 is not divisible by tensor_parallel_size=4.*\[1, 2\]"):
        ParallelConfig(tensor_parallel_size=4).resolve(4).validate_model(model)


def test_alltoall_context_parallel_needs_heads_split_over_tp_and_cp():
    """Ulysses shards heads over tp, then cp: a/tp divisible by cp; kv heads per tp rank divisible by cp, or dividing
    it (then replicated: accepted). Refused in validate_model, before any process group."""
    tiny = LlamaConfig.from_preset("tiny-test")  # 4 heads, 2 kv heads

    def check(model, tp, cp):
        ParallelConfig(tensor_parallel_size=tp, context_parallel_size=cp, context_parallel_method="alltoall").resolve(
            tp * cp
        ).validate_model(model)

    with pytest.raises(
        ValueError,
        match=r"num_heads/tensor_parallel_size = 4/2 = 2, divisible by context_parallel_size=4 .*\[1, 2\]",
    ):
        check(tiny, 2, 4)
    gqa = LlamaConfig(hidden_size=96, num_heads=12, num_kv_heads=6, intermediate_size=192)
    with pytest.raises(ValueError, match=r"num_kv_heads/tensor_parallel_size = 6/1 = 6, divisible by context_par"):
        check(gqa, 1, 4)
    assert not dist.is_initialized()
    for tp, cp in ((1, 2), (1, 4), (2, 2)):  # kv heads per tp rank 2, 2, 1: split at cp 2, replicated at 4 and 2x2
        check(tiny, tp, cp)
    check(gqa, 1, 3)  # 12 heads and 6 kv heads over 3
    # the ring and the all-gather take what alltoall refuses
    ParallelConfig(tensor_parallel_size=2, context_parallel_size=4).resolve(8).validate_model(tiny)


def test_vocab_not_divisible_by_tp_says_how_to_pad():
    model = LlamaConfig(vocab_size=32001, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
    with pytest.raises(
        ValueError,
        match=r"vocab_size=32001 .* pad_vocab_to_multiple_of=2 in the model config "
        r"\(pads the vocabulary to 32002",
    ):
        ParallelConfig(tensor_parallel_size=2).resolve(2).validate_model(model)
    padded = LlamaConfig(
        vocab_size=32001, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, pad_vocab_to_multiple_of=2
    )
    ParallelConfig(tensor_parallel_size=2).resolve(2).validate_model(padded)  # accepted once padded


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"llama5-1t.*llama3-8b"):
        LlamaConfig.from_preset("llama5-1t")


def test_sequence_length_with_sequence_parallel():
    with pytest.raises(ValueError, match=r"seq_length=30 is not a multiple of 4 \(tp=4 with sequence parallelism\)"):
        ParallelConfig(tensor_parallel_size=4).validate_sequence(30)
    ParallelConfig(tensor_parallel_size=4, sequence_parallel=False).validate_sequence(30)


def test_cp_layout_and_sequence_divisor():
    config = ParallelConfig(pipeline_parallel_size=2, context_parallel_size=2).resolve(8)
    assert config.mesh_shape == (2, 2, 2, 1)
    assert config.dp_cp == 4
    assert ParallelConfig(context_parallel_size=4, tensor_parallel_size=2).sequence_divisor == 16
    with pytest.raises(ValueError, match=r"seq_length=36 is not a multiple of 8 \(2\*cp=8\)"):
        ParallelConfig(context_parallel_size=4).validate_sequence(36)
    with pytest.raises(
        ValueError,
        match=r"seq_length=40 is not a multiple of 16 \(tp=2 with sequence parallelism "
        r"and 2\*cp=8\); use e.g. seq_length=48",
    ):
        ParallelConfig(context_parallel_size=4, tensor_parallel_size=2).validate_sequence(40)
    ParallelConfig(context_parallel_size=4, tensor_parallel_size=2).validate_sequence(48)


def test_unknown_context_parallel_method():
    with pytest.raises(
        ValueError,
        match=r"context_parallel_method='ulysses' is not valid: expected one of "
        r"\['ring', 'allgather', 'alltoall'\]",
    ):
        ParallelConfig(context_parallel_size=2, context_parallel_method="ulysses")
    with pytest.raises(ValueError, match="context_parallel_method='zigzag'"):
        FourDStrategy(context_parallel_size=2, context_parallel_method="zigzag")


def test_trainer_with_wrong_world_size_fails_before_any_process_group():
    import lightning as L

    with pytest.raises(ValueError, match=r"world size 2 != pp\*dp\*cp\*tp"):
        L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FourDStrategy(data_parallel_size=2, tensor_parallel_size=2),
            logger=False,
        )
    assert not dist.is_initialized()


def test_trainer_with_context_parallel_and_bad_sequence_fails_before_any_process_group():
    import lightning as L

    from lightning_4d.data import LMDataModule
    from lightning_4d.parallel.parallelize import validate_against_module
    from lightning_4d.tasks import CausalLMModule

    strategy = FourDStrategy(context_parallel_size=2, process_group_backend="gloo")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        max_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    assert strategy.parallel_config.mesh_shape == (1, 1, 2, 1)
    module = CausalLMModule("tiny-test")
    strategy._lightning_module = module
    module.trainer = trainer
    trainer.datamodule = LMDataModule(seq_length=30, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"seq_length=30 is not a multiple of 4 \(2\*cp=4\); use e.g. seq_length=32"):
        validate_against_module(strategy.parallel_config, module)
    trainer.datamodule = LMDataModule(seq_length=32, micro_batch_size=1)
    validate_against_module(strategy.parallel_config, module)
    assert not dist.is_initialized()


def test_sequence_parallel_defaults_on_with_tp():
    assert ParallelConfig(tensor_parallel_size=2).sp
    assert not ParallelConfig(tensor_parallel_size=2, sequence_parallel=False).sp
    assert not ParallelConfig(tensor_parallel_size=1, sequence_parallel=True).sp


def test_compile_with_selective_checkpointing_is_refused_at_construction():
    """Selective checkpointing is refused with compile, under tp too; tp with full checkpointing is accepted (its
    training run: tests/test_compile.py)."""
    for tp in (1, 2):
        with pytest.raises(ValueError, match="compile=True with activation_checkpointing='selective'"):
            FourDStrategy(tensor_parallel_size=tp, activation_checkpointing="selective", compile=True)
        FourDStrategy(tensor_parallel_size=tp, activation_checkpointing="full", compile=True)


def test_zero1_needs_distributed_checkpoints():
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False is not supported with zero_stage=1"):
        FourDStrategy(zero_stage=1, save_distributed_checkpoint=False)
    FourDStrategy(zero_stage=3, save_distributed_checkpoint=False)


def test_tokenizer_larger_than_model_vocabulary():
    from lightning_4d.data import LMDataModule
    from lightning_4d.tasks import CausalLMModule

    module = CausalLMModule(
        LlamaConfig(vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
    )
    with pytest.raises(ValueError, match=r"the tokenizer has 256 tokens but the model's vocab_size is 128"):
        module.validate_datamodule(LMDataModule())
    CausalLMModule("tiny-test").validate_datamodule(LMDataModule())


def test_flops_per_token_is_palm_model_flops():
    """6N + 12·L·h·s (PaLM, arXiv 2204.02311, appendix B), N = num_parameters(), by hand for llama3-8b at s=8192."""
    cfg = LlamaConfig.from_preset("llama3-8b")
    # N: 32 layers x (4096·4096 wq + 2·4096·1024 wk, wv + 4096·4096 wo + 3·4096·14336 ffn + 2·4096 norms)
    #    + 128256·4096 embedding + 4096 final norm + 128256·4096 head
    n = 32 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 128256 * 4096 + 4096
    assert n == cfg.num_parameters() == 8_030_261_248
    assert cfg.flops_per_token(8192) == 6 * n + 12 * 32 * 4096 * 8192 == 61_066_469_376
    with pytest.raises(ValueError, match="seq_length=0"):
        cfg.flops_per_token(0)


def test_gradient_bucket_rules():
    """The one definition of ZeRO 0/1 buckets (parallel/grad_buffers.py builds them, planning/model.py simulates
    them)."""
    from lightning_4d.partition import bucket_lengths, bucket_shard

    assert bucket_lengths([10, 10, 10, 30, 5], 25) == [2, 1, 1, 1]  # 20 | 10 | 30 (alone, too large) | 5
    assert bucket_lengths([], 25) == []
    assert sum(bucket_lengths([7] * 13, 20)) == 13
    # 10 elements over 4 ranks: padded to 12, ranges of 3; the last rank holds 1 real element and 2 of padding
    assert [bucket_shard(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"gradient_compression": "zip"},
            r"gradient_compression='zip' is not valid: expected one of \['none', 'bf16', "
            r"'powersgd'\]",
        ),
        ({"powersgd_rank": 0}, "powersgd_rank=0 is not valid"),
        ({"powersgd_start_step": -1}, r"powersgd_start_step=-1 is not valid: expected an integer >= 0"),
        ({"powersgd_start_step": True}, r"powersgd_start_step=True is not valid"),
        (
            {"powersgd_comm_dtype": "float8"},
            r"powersgd_comm_dtype='float8' is not valid: expected one of \[None, "
            r"'bfloat16'\]",
        ),
        ({"gradient_compression": "powersgd", "zero_stage": 3}, r"'powersgd' is not supported with zero_stage=3"),
    ],
)
def test_gradient_compression_options_are_checked(kwargs, match):
    """Bad compression options fail in ParallelConfig, before any process group, naming the value and the valid ones
    (FourDStrategy's arguments are the same fields)."""
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        FourDStrategy(**kwargs)
