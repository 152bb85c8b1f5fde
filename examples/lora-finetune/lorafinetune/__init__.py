"""A FlowerTune-style LoRA fine-tuning app (Shakespeare roles as the clients' text) with fedcomp."""
