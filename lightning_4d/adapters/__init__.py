"""Foreign model families the strategy can split, one file each (:mod:`lightning_4d.adapters.hf_llama`: Hugging Face
transformers' ``LlamaForCausalLM``)."""
