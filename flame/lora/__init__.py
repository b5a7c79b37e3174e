"""LoRA: low-rank adapters on a frozen base (``[lora]``), their merge and their PEFT export."""

from flame.lora.config import Lora
from flame.lora.layer import LoRALinear, apply_lora, init_adapters, is_adapter_key

__all__ = ["Lora", "LoRALinear", "apply_lora", "init_adapters", "is_adapter_key"]
