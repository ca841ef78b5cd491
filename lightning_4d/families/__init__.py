"""Model families: one interface (:mod:`lightning_4d.families.base`), implemented once per kind of model (our Llama in
:mod:`lightning_4d.families.native_llama`, transformers' ``LlamaForCausalLM`` in
:mod:`lightning_4d.adapters.hf_llama`), and the registry the strategy asks (:mod:`lightning_4d.families.registry`).
Hugging Face safetensors I/O shared by the
families: :mod:`lightning_4d.families.hf_io`.

This package file imports nothing, so that a family file can import the interface without loading the registry
(which imports every family)."""
