"""lightning_4d: 4D-parallel Llama training for PyTorch Lightning."""
